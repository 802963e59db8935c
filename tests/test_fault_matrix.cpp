// Faults at the phases the other suites do not cover: a worker stopped (SIGSTOP) during a call, and a worker killed
// during a distributed backward. The kill is made deterministic by stopping the
// worker first, starting the phase (its messages are then surely in flight to a frozen peer), then killing it.
// (Covered elsewhere: SIGKILL mid-call, test_rpc; of an RRef owner during to_here, test_rref; during a pipeline step,
// test_pipeline; of the master, test_rpc.)
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"
#include "leak_checks.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;

namespace {

int pid_of() { return static_cast<int>(::getpid()); }
int add(int a, int b) { return a + b; }
at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }

// The survivors' contexts: none left once the failed phase is over (those tied to the dead worker included).
void expect_no_contexts_on(std::initializer_list<int> ranks) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    std::uint64_t live = 0;
    for (int r : ranks) live += da::live_contexts(r).wait(10s);
    if (live == 0) return;
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error(std::to_string(live) + " contexts leaked");
    std::this_thread::sleep_for(10ms);
  }
}

// Runs a 3-rank job in which rank 2 is expected to be killed: the survivors must end by themselves, and only rank 2
// may be reported failed, by a signal.
void run_world_losing_rank2(const std::function<void(int)>& body) {
  try {
    run_world(3, body, quick_options(), 60s);
    FAIL("worker2 was expected to be killed");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 2);
    CHECK(e.failures()[0].reason.find("signal") != std::string::npos);
  }
}

}  // namespace

TEST_CASE("a worker stopped mid-call: TimeoutError naming it at the deadline, and it serves again after SIGCONT") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    ::kill(pid, SIGSTOP);
    auto what = EXPECT_THROWS_AS(rpc_async<&add>(2, with_timeout(500ms), 1, 2).wait(20s), TimeoutError);
    EXPECT(what.find("worker2") != std::string::npos);
    EXPECT_EQ(rpc_sync<&add>(1, 2, 2), 4);  // the others are not held up
    ::kill(pid, SIGCONT);
    EXPECT_EQ(rpc_sync<&add>(2, 3, 3), 6);
  });
}

TEST_CASE("a worker killed during a distributed backward: the backward fails naming it; contexts are released") {
  run_world_losing_rank2([](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    auto w = at::rand({4}).set_requires_grad(true);
    {
      da::Context ctx;
      auto loss = rpc_sync<&times_three_sum>(1, w * 2) + rpc_sync<&times_three_sum>(2, w * 2);
      ::kill(pid, SIGSTOP);
      auto pass = ctx.backward({loss});
      ::kill(pid, SIGKILL);
      auto what = EXPECT_THROWS_AS(pass.wait(20s), ConnectionError);
      EXPECT(what.find("worker2") != std::string::npos);
    }
    expect_no_contexts_on({0, 1});
  });
}
