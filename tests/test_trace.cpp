// Job traces (corpc/core/trace.hpp): a real 3-worker run with tracing on leaves one merged Chrome trace that parses as
// JSON, has a track per worker, the events of what was done, and a matching end for every flow start.
#include <ATen/ATen.h>
#include <doctest/doctest.h>  // its macros spelled DOCTEST_*: torch's headers bring glog's CHECK
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/core/trace.hpp"
#include "corpc/rref/rref.hpp"

#include "../tools/mini_json.hpp"
#include "support.hpp"

// Outside any namespace, so that the slices carry the plain names ("add → worker1").
int add(int a, int b) { return a + b; }
at::Tensor scale(at::Tensor t, double k) { return t * k; }
std::string whoami() { return corpc::get_worker_info().name; }
// worker1 asks worker2 on the caller's behalf: the nested call master → worker1 → worker2.
corpc::Task<std::string> relay(std::string to) { co_return co_await corpc::rpc_async<&whoami>(to); }

namespace test_trace {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;

namespace {

mini_json::Value read_json(const std::string& path) {
  std::ifstream f(path);
  REQUIRE_MESSAGE(f.good(), "no trace at " << path);
  std::stringstream ss;
  ss << f.rdbuf();
  return mini_json::parse(ss.str());
}

bool contains(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

struct TempDir {
  std::string path;
  TempDir() {
    char dir[] = "/tmp/corpc_trace_XXXXXX";
    REQUIRE(::mkdtemp(dir));
    path = dir;
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

}  // namespace

TEST_CASE("a 3-worker job's trace: a track per worker, calls and their executions joined by flows") {
  TempDir dir;
  const std::string path = dir.path + "/job.json";
  RpcOptions options = quick_options();
  options.trace_path = path;
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        EXPECT_EQ(rpc_sync<&add>("worker1", 2, 3), 5);
        EXPECT_EQ(rpc_sync<&relay>("worker1", std::string("worker2")), std::string("worker2"));
        RRef<int> r = remote<&add>("worker2", 4, 5);
        EXPECT_EQ(r.to_here().wait(), 9);
        const at::Tensor big = at::ones({512, 512});  // 1 MiB each way: a large transfer
        EXPECT(rpc_sync<&scale>("worker1", big, 2.0).sum().item<double>() == 2.0 * 512 * 512);
        dist_autograd::Context ctx;
        const at::Tensor x = at::ones({4}).set_requires_grad(true);
        ctx.backward({rpc_sync<&scale>("worker2", x, 3.0).sum()}).wait();
        EXPECT(at::allclose(ctx.gradients().at(x), at::full({4}, 3.0)));
      },
      options);

  // Merged by rank 0 at shutdown; the parts are gone.
  for (int r = 0; r < 3; ++r) DOCTEST_CHECK_FALSE(std::filesystem::exists(trace::part_path(path, r)));
  const auto trace = read_json(path);
  const auto& events = trace["traceEvents"].arr();

  std::map<int, std::string> processes;                 // pid -> worker name
  std::map<int, std::multiset<std::string>> slices;     // pid -> names of its complete events
  std::map<std::string, std::pair<int, int>> flows[2];  // by name ("call", "reply"): id -> (start pid, end pid)
  std::map<std::string, int> starts, ends;
  for (const auto& e : events) {
    const std::string ph = e["ph"].str();
    const int pid = static_cast<int>(e["pid"].num());
    if (ph == "M" && e["name"].str() == "process_name") processes[pid] = e["args"]["name"].str();
    if (ph == "X") {
      DOCTEST_CHECK(e["ts"].is_number());
      DOCTEST_CHECK(e["dur"].num() > 0);
      slices[pid].insert(e["name"].str());
    }
    if (ph == "s" || ph == "f") {
      const std::string key = e["name"].str() + " " + e["id"].str();
      (ph == "s" ? starts : ends)[key] += 1;
      auto& f = flows[e["name"].str() == "reply"][e["id"].str()];
      (ph == "s" ? f.first : f.second) = pid;
    }
  }
  // One track per worker, named after it.
  DOCTEST_CHECK((processes == std::map<int, std::string>{{1, "master"}, {2, "worker1"}, {3, "worker2"}}));

  auto has = [&](int pid, std::string_view part) {
    for (auto& n : slices[pid])
      if (contains(n, part)) return true;
    return false;
  };
  // The caller's side, the callee's side, and the reply, of each kind of work.
  DOCTEST_CHECK(has(1, "add → worker1"));
  DOCTEST_CHECK(has(2, "add ← master"));
  DOCTEST_CHECK(has(1, "reply add ← worker1"));
  DOCTEST_CHECK(has(2, "relay ← master"));  // the nested call: master → worker1 → worker2
  DOCTEST_CHECK(has(2, "whoami → worker2"));
  DOCTEST_CHECK(has(3, "whoami ← worker1"));
  DOCTEST_CHECK(has(2, "reply relay → master"));
  DOCTEST_CHECK(has(3, "add> ← master"));  // remote() runs add on worker2 (corpc::rref_remote<add>) ...
  DOCTEST_CHECK(has(3, "rref_fetch"));     // ... and to_here fetches the value
  DOCTEST_CHECK(has(1, "send 1.0 MiB → worker1"));
  DOCTEST_CHECK(has(2, "receive 1.0 MiB ← master"));
  DOCTEST_CHECK(has(2, "send 1.0 MiB → master"));
  DOCTEST_CHECK(has(1, "backward ctx 0:"));  // the backward pass on the master and on worker2
  DOCTEST_CHECK(has(3, "backward ctx 0:"));

  // Every flow that starts ends exactly once, in another worker: call arrows from caller to callee, reply arrows back.
  DOCTEST_CHECK(!starts.empty());
  DOCTEST_CHECK(starts == ends);
  for (auto& [key, n] : starts) DOCTEST_CHECK_MESSAGE(n == 1, key);
  for (auto& by_id : flows)
    for (auto& [id, f] : by_id) DOCTEST_CHECK_MESSAGE((f.first != f.second && f.first > 0 && f.second > 0), id);
}

TEST_CASE("merging by hand: parts that exist merge, a truncated last line is dropped") {
  TempDir dir;
  const std::string a = dir.path + "/a.json", b = dir.path + "/b.json", out = dir.path + "/out.json";
  REQUIRE(trace::write_chrome_trace(
      a, {trace::process_name_event(1, "w\"0", 0),
          trace::ChromeEvent('X', 1, 1).name("f → w1").cat("call").ts(1).dur(2).arg("bytes", 64).str()}));
  {
    std::ofstream f(b);  // a worker killed while writing its part
    f << "{\"traceEvents\":[\n"
      << trace::ChromeEvent('X', 2, 1).name("g").ts(3).dur(1).str() << ",\n{\"ph\":\"X\",\"na";
  }
  DOCTEST_CHECK(trace::merge_chrome_traces(out, {a, b, dir.path + "/missing.json"}) == 4);
  const auto merged = read_json(out);
  DOCTEST_CHECK(merged["traceEvents"].arr().size() == 4);
  DOCTEST_CHECK(merged["traceEvents"].arr()[0]["args"]["name"].str() == "w\"0");
}

}  // namespace test_trace
