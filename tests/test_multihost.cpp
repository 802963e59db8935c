// Workers on separate "hosts": each rank runs in its own network namespace with its own address, joined to the others
// through veth pairs on a bridge (in a namespace of its own), so connections really cross interfaces and a link can be
// cut. Needs root and iproute2 (CI runs as root); elsewhere each case says why it is skipped. Addresses are private to
// the namespaces this test creates (10.213.x.0/24) and disappear with them.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"

#include "leak_checks.hpp"
#include "support.hpp"

namespace test_multihost {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;

namespace {

constexpr int kWorld = 3;

// The namespaces and links of one test: created in the constructor, deleted (with every address in them) at the end.
class Hosts {
 public:
  Hosts() : id_(std::to_string(::getpid() % 100000)), subnet_(std::to_string(::getpid() % 250)) {
    if (::geteuid() != 0) {
      why_not_ = "needs root to create network namespaces";
      return;
    }
    std::string script = "set -e; ip netns add " + ns("sw") + "; ip -n " + ns("sw") + " link add br0 type bridge; " +
                         "ip -n " + ns("sw") + " link set br0 up; ";
    for (int r = 0; r < kWorld; ++r) {
      const std::string host = ns(std::to_string(r)), port = "mh" + id_ + "p" + std::to_string(r);
      script += "ip netns add " + host + "; ip -n " + host + " link set lo up; " + "ip link add " + port +
                " type veth peer name eth0 netns " + host + "; " + "ip link set " + port + " netns " + ns("sw") + "; " +
                "ip -n " + ns("sw") + " link set " + port + " master br0 up; " + "ip -n " + host + " addr add " +
                address(r) + "/24 dev eth0; " + "ip -n " + host + " link set eth0 up; ";
    }
    if (std::system(("(" + script + ") >/dev/null 2>&1").c_str()) != 0)
      why_not_ = "cannot create network namespaces and veth pairs here (ip netns / ip link failed)";
  }
  ~Hosts() {
    std::string script;
    for (int r = 0; r < kWorld; ++r) script += "ip netns del " + ns(std::to_string(r)) + "; ";
    script += "ip netns del " + ns("sw") + "; ";
    int rc = std::system(("(" + script + ") >/dev/null 2>&1").c_str());
    (void)rc;
  }
  bool usable() const { return why_not_.empty(); }
  const std::string& why_not() const { return why_not_; }
  std::string ns(const std::string& which) const { return "corpc-mh-" + id_ + "-" + which; }
  std::string address(int rank) const { return "10.213." + subnet_ + "." + std::to_string(rank + 1); }
  void set_link(int rank, bool up) const {
    const std::string cmd = "ip -n " + ns(std::to_string(rank)) + " link set eth0 " + (up ? "up" : "down");
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error(cmd + " failed");
  }

  // Runs `body(rank)` with each rank inside its own namespace, rendezvous at rank 0's address.
  void run(const std::function<void(int)>& body, RpcOptions options = quick_options()) const {
    const LaunchOptions lo = launch_options(120s);
    launch_processes(
        kWorld,
        [&](int rank) {
          const int fd = ::open(("/run/netns/" + ns(std::to_string(rank))).c_str(), O_RDONLY | O_CLOEXEC);
          if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) throw std::runtime_error("cannot enter this rank's namespace");
          ::close(fd);
          // The launcher's pre-bound socket is in the test's own namespace: rendezvous on this host's address instead.
          ::unsetenv("CORPC_LISTEN_FD");
          ::setenv("MASTER_ADDR", address(0).c_str(), 1);
          ::setenv("MASTER_PORT", "29517", 1);
          options.listen_address = address(rank);
          init_rpc(worker_name(rank), rank, kWorld, options);
          body(rank);
          shutdown(true);
        },
        lo);
  }

 private:
  std::string id_, subnet_, why_not_;
};

// Whether this machine lets the test build its hosts at all (root, network namespaces, veth pairs): decided once,
// before the cases are registered, so that they are reported as skipped rather than passed where it does not.
bool hosts_can_be_made() {
  if (::geteuid() != 0) return false;
  const std::string probe = "corpc-mh-probe-" + std::to_string(::getpid());
  const std::string script = "set -e; ip netns add " + probe + "; ip -n " + probe + " link set lo up; ip link add " +
                             probe.substr(0, 8) + std::to_string(::getpid() % 100000) +
                             " type veth peer name eth0 netns " + probe;
  const bool ok = std::system(("(" + script + ") >/dev/null 2>&1").c_str()) == 0;
  int rc = std::system(("ip netns del " + probe + " >/dev/null 2>&1").c_str());  // takes the veth pair with it
  (void)rc;
  return ok;
}
const bool g_no_hosts = !run_is_for("test_multihost.cpp") || !hosts_can_be_made();

WorkerInfo whoami() { return get_worker_info(); }
int square(int x) { return x * x; }
at::Tensor make_tensor(std::int64_t n) { return at::ones({n}); }
at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }
int slow_echo(int x) {
  std::this_thread::sleep_for(300ms);
  return x;
}

}  // namespace

TEST_CASE("RPC, RRefs and distributed autograd across hosts" * doctest::skip(g_no_hosts)) {
  Hosts hosts;
  REQUIRE_MESSAGE(hosts.usable(), hosts.why_not());
  hosts.run([&](int rank) {
    if (rank != 0) return;
    for (int r = 1; r < kWorld; ++r) {
      auto info = rpc_sync<&whoami>(r);
      EXPECT_EQ(info.host, hosts.address(r));  // each worker listens on, and is reached at, its own host
      EXPECT_EQ(rpc_sync<&square>(r, r + 3), (r + 3) * (r + 3));
    }
    // A reference owned on worker1, used from worker2 (a fork between two other hosts).
    auto ref = remote<&make_tensor>("worker1", std::int64_t{4});
    EXPECT(at::equal(ref.to_here().wait(10s), at::ones({4})));
    auto w = at::rand({5}).set_requires_grad(true);
    {
      da::Context ctx;
      auto t = w * 2;
      auto loss = rpc_sync<&times_three_sum>(1, t) + rpc_sync<&times_three_sum>(2, t);
      ctx.backward({loss}).wait(30s);
      EXPECT(at::allclose(ctx.gradients().at(w), at::full({5}, 12.0)));
    }
    ref = {};
    expect_no_references(kWorld);
    expect_no_contexts(kWorld);
  });
}

TEST_CASE("a link cut mid-call fails that call with a typed error; the others go on; restored, the job ends" *
          doctest::skip(g_no_hosts)) {
  Hosts hosts;
  REQUIRE_MESSAGE(hosts.usable(), hosts.why_not());
  hosts.run([&](int rank) {
    if (rank != 0) return;
    EXPECT_EQ(rpc_sync<&square>(2, 3), 9);  // the connection to worker2 exists before the cut
    auto call = rpc_async<&slow_echo>("worker2", with_timeout(2s), 5);
    hosts.set_link(2, false);
    // No byte comes back and no reset either: the call's deadline is what ends it, with the worker's name.
    auto what = EXPECT_THROWS_AS(call.wait(20s), TimeoutError);
    EXPECT(what.find("worker2") != std::string::npos);
    EXPECT_EQ(rpc_sync<&square>("worker1", 4), 16);  // the cut isolates worker2 only
    hosts.set_link(2, true);
    EXPECT_EQ(rpc_sync<&square>("worker2", 5), 25);  // TCP recovers once the link is back
  });
}

}  // namespace test_multihost
