// The function registry (Registry), in process, on real objects (no workers, no mocks): lookups by a name's id,
// replacement, hash collisions, snapshots read while another thread registers; and register_function, whose entry
// decodes its arguments and runs the function.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_registry {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {

int add_ints(int a, int b) { return a + b; }
void no_op(Inbound&, Message&) {}

HandlerEntry entry(std::string name, std::uint64_t signature = 0, Execution execution = Execution::worker_pool) {
  HandlerEntry e;
  e.name = std::move(name);
  e.signature = signature;
  e.signature_text = std::to_string(signature);
  e.execution = execution;
  e.run_sync = &no_op;
  return e;
}

// Two names with the same 64-bit FNV-1a hash (found by lattice reduction over the hash's multiplier).
constexpr std::string_view kCollidingA = "R369pZl-U:1CZ.";
constexpr std::string_view kCollidingB = "_Z222Te:cu8HQ3";

}  // namespace

TEST_CASE("Registry: an entry is found by the id of its name; add sets the id; absent ids find nothing") {
  Registry r;
  CHECK(r.find(function_id("corpc.test.alpha")) == nullptr);  // empty: no snapshot yet
  HandlerEntry alpha = entry("corpc.test.alpha", 7, Execution::io_thread);
  alpha.id = 12345;  // whatever the entry says, the id is the name's
  r.add(std::move(alpha));
  const HandlerEntry* found = r.find(function_id("corpc.test.alpha"));
  REQUIRE(found != nullptr);
  CHECK(found->name == "corpc.test.alpha");
  CHECK(found->id == function_id("corpc.test.alpha"));
  CHECK(found->signature == 7);
  CHECK(found->execution == Execution::io_thread);
  CHECK((found->run_sync == &no_op));
  CHECK(r.find(12345) == nullptr);
  CHECK(r.find(function_id("corpc.test.beta")) == nullptr);

  // Many entries, registered in shuffled order: each is found under its own id, nothing else is.
  std::vector<std::string> names;
  for (int i = 0; i < 200; ++i) names.push_back("corpc.test.fn" + std::to_string(i));
  std::vector<std::string> shuffled = names;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
  for (auto& n : shuffled) r.add(entry(n, function_id(n) ^ 1));
  for (auto& n : names) {
    const HandlerEntry* e = r.find(function_id(n));
    REQUIRE(e != nullptr);
    CHECK(e->name == n);
    CHECK(e->signature == (function_id(n) ^ 1));
  }
  CHECK(r.find(function_id("corpc.test.fn200")) == nullptr);
  CHECK(r.find(0) == nullptr);
  CHECK(r.find(~std::uint64_t{0}) == nullptr);
  CHECK(r.find(function_id("corpc.test.alpha")) != nullptr);
}

TEST_CASE("Registry: registering a name again replaces its entry; a pointer found before stays valid and unchanged") {
  Registry r;
  r.add(entry("corpc.test.f", 1, Execution::worker_pool));
  r.add(entry("corpc.test.g", 5));
  const HandlerEntry* before = r.find(function_id("corpc.test.f"));
  REQUIRE(before != nullptr);
  r.add(entry("corpc.test.f", 2, Execution::io_thread));
  const HandlerEntry* after = r.find(function_id("corpc.test.f"));
  REQUIRE(after != nullptr);
  CHECK(after->signature == 2);
  CHECK(after->execution == Execution::io_thread);
  // A reader that found the entry before the replacement still reads the old one, whole (snapshots are never freed).
  CHECK(before->name == "corpc.test.f");
  CHECK(before->signature == 1);
  CHECK(before->signature_text == "1");
  CHECK(before->execution == Execution::worker_pool);
  // The other entries are untouched.
  const HandlerEntry* g = r.find(function_id("corpc.test.g"));
  REQUIRE(g != nullptr);
  CHECK(g->signature == 5);
}

TEST_CASE("Registry: a second name with the same id is refused with UsageError naming both; the first stays") {
  REQUIRE(kCollidingA != kCollidingB);
  REQUIRE(function_id(kCollidingA) == function_id(kCollidingB));
  Registry r;
  r.add(entry(std::string(kCollidingA), 1));
  try {
    r.add(entry(std::string(kCollidingB), 2));
    FAIL("a colliding name was accepted");
  } catch (const UsageError& e) {
    const std::string what = e.what();
    CHECK(what.find(std::string(kCollidingA)) != std::string::npos);
    CHECK(what.find(std::string(kCollidingB)) != std::string::npos);
  }
  const HandlerEntry* e = r.find(function_id(kCollidingA));
  REQUIRE(e != nullptr);
  CHECK(e->name == kCollidingA);
  CHECK(e->signature == 1);
  // The refusal published nothing: the first name can still be replaced, and the table still grows.
  r.add(entry(std::string(kCollidingA), 3));
  r.add(entry("corpc.test.other", 4));
  CHECK(r.find(function_id(kCollidingA))->signature == 3);
  CHECK(r.find(function_id("corpc.test.other")) != nullptr);
}

TEST_CASE("Registry: lookups while another thread registers see whole snapshots that only grow") {
  // The writer registers n0, n1, ... in order and keeps replacing "hot" (its signature and text agree in each
  // version). A reader that finds n_k must then find every n_j, j < k (later snapshots contain earlier ones), must
  // never lose a name it saw, and must never see a torn entry.
  Registry r;
  constexpr int kNames = 400;
  std::vector<std::string> names;
  for (int i = 0; i < kNames; ++i) names.push_back("corpc.test.n" + std::to_string(i));
  r.add(entry("corpc.test.hot", 0));
  std::atomic<bool> done{false};
  std::atomic<int> wrong{0}, reads{0};
  auto reader = [&] {
    int seen = -1;
    while (!done.load()) {
      int highest = -1;
      for (int i = kNames - 1; i >= 0; --i) {
        if (const HandlerEntry* e = r.find(function_id(names[static_cast<std::size_t>(i)]))) {
          if (e->name != names[static_cast<std::size_t>(i)]) ++wrong;
          highest = i;
          break;
        }
      }
      if (highest < seen) ++wrong;  // a registered name disappeared
      seen = std::max(seen, highest);
      for (int j = 0; j < highest; ++j)
        if (r.find(function_id(names[static_cast<std::size_t>(j)])) == nullptr) ++wrong;
      const HandlerEntry* hot = r.find(function_id("corpc.test.hot"));
      if (!hot || hot->signature_text != std::to_string(hot->signature)) ++wrong;
      ++reads;
    }
  };
  // Every 50 names the writer waits (bounded) for the readers to finish a few passes, so that reads interleave with
  // the registrations however the threads are scheduled.
  auto let_readers_read = [&] {
    const int at = reads.load();
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (reads.load() < at + 4 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  };
  std::thread r1(reader), r2(reader);
  let_readers_read();
  const int reads_before = reads.load();
  for (int i = 0; i < kNames; ++i) {
    r.add(entry(names[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
    r.add(entry("corpc.test.hot", static_cast<std::uint64_t>(i + 1)));
    if (i % 50 == 25) let_readers_read();
  }
  const int reads_while_writing = reads.load() - reads_before;
  done = true;
  r1.join();
  r2.join();
  CHECK(wrong.load() == 0);
  CHECK(reads_while_writing >= 8 * 4);  // the readers really did read while the table changed
  for (auto& n : names) CHECK(r.find(function_id(n)) != nullptr);
  CHECK(r.find(function_id("corpc.test.hot"))->signature == std::uint64_t{kNames});
}

TEST_CASE("register_function adds an entry to the global registry that decodes its arguments and runs the function") {
  const std::string name = "corpc.test.add_ints";
  CHECK(global_registry().find(function_id(name)) == nullptr);
  register_function<&add_ints>(name, Execution::io_thread);
  const HandlerEntry* e = global_registry().find(function_id(name));
  REQUIRE(e != nullptr);
  CHECK(e->name == name);
  CHECK(e->execution == Execution::io_thread);
  CHECK(e->signature == corpc::detail::signature_of<std::tuple<int, int>>());
  REQUIRE((e->run_sync != nullptr));

  Message request;
  corpc::detail::encode_args<std::tuple<int, int>>(request, 0, 20, 22);
  Inbound in{0, e->name, Reader(request.body.data(), request.body.size()), &request};
  in.args.tensors = &request.tensors;
  Message reply;
  e->run_sync(in, reply);
  Reader result(reply.body.data(), reply.body.size());
  CHECK(result.get<int>() == 42);
}

}  // namespace test_registry
