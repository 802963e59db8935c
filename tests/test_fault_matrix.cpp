// Faults at the phases the other suites do not cover: a worker stopped (SIGSTOP) during a call and during to_here,
// and a worker killed during to_here, a distributed backward and a DistributedOptimizer step. A kill is made
// deterministic by stopping the worker first, starting the phase (its messages are then surely in flight to a frozen
// peer), then killing it. (Covered elsewhere: SIGKILL mid-call, test_rpc; of an RRef owner while its value is being
// made, test_rref; SIGKILL and SIGSTOP during a pipeline step, test_pipeline; of the master, test_rpc.)
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include "corpc/autograd/dist_autograd.hpp"
#include <torch/optim/sgd.h>

#include "corpc/autograd/optimizer.hpp"
#include "corpc/rref/rref.hpp"
#include "leak_checks.hpp"
#include "stop_process.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;

namespace {

int pid_of() { return static_cast<int>(::getpid()); }
int add(int a, int b) { return a + b; }
at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }
at::Tensor ones(std::int64_t n) { return at::ones({n}); }
at::Tensor param(std::int64_t n) { return at::ones({n}).set_requires_grad(true); }
at::Tensor scaled_sum(RRef<at::Tensor> p, at::Tensor x) { return (p.local_value() * x).sum(); }

// Runs a 3-rank job in which rank 2 is expected to be killed: the survivors must end by themselves, and only rank 2
// may be reported failed, by a signal.
void run_world_losing_rank2(const std::function<void(int)>& body) {
  expect_only_rank_lost(2, "signal", [&] { run_world(3, body, quick_options(), 60s); });
}

}  // namespace

TEST_CASE("a worker stopped mid-call: TimeoutError naming it at the deadline, and it serves again after SIGCONT") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    stop_process(pid);
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
      stop_process(pid);
      auto pass = ctx.backward({loss});
      ::kill(pid, SIGKILL);
      auto what = EXPECT_THROWS_AS(pass.wait(20s), ConnectionError);
      EXPECT(what.find("worker2") != std::string::npos);
    }
    expect_no_contexts_on({0, 1});
  });
}

TEST_CASE("an RRef owner killed during to_here: ConnectionError naming it; the survivors hold no references") {
  run_world_losing_rank2([](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    {
      auto r = remote<&ones>("worker2", std::int64_t{1 << 20});
      EXPECT_EQ(r.to_here().wait(20s).numel(), 1 << 20);  // created and confirmed
      stop_process(pid);
      auto fetch = r.to_here();
      ::kill(pid, SIGKILL);
      auto what = EXPECT_THROWS_AS(fetch.wait(20s), ConnectionError);
      EXPECT(what.find("worker2") != std::string::npos);
    }
    expect_no_references_on({0, 1});
  });
}

TEST_CASE("an RRef owner stopped during to_here: TimeoutError at the deadline, and to_here works after SIGCONT") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    {
      auto r = remote<&ones>("worker2", std::int64_t{16});
      EXPECT_EQ(r.to_here().wait(20s).numel(), 16);
      stop_process(pid);
      auto what = EXPECT_THROWS_AS(r.to_here(with_timeout(500ms)).wait(20s), TimeoutError);
      EXPECT(what.find("worker2") != std::string::npos);
      ::kill(pid, SIGCONT);
      EXPECT_EQ(r.to_here().wait(20s).numel(), 16);
    }
    expect_no_references_on({0, 1, 2});
  });
}

TEST_CASE("an owner killed during a DistributedOptimizer step: the step fails naming it; contexts are released") {
  run_world_losing_rank2([](int rank) {
    if (rank != 0) return;
    const pid_t pid = rpc_sync<&pid_of>(2);
    {
      std::vector<RRef<at::Tensor>> params{remote<&param>("worker1", std::int64_t{4}),
                                           remote<&param>("worker2", std::int64_t{4})};
      // Made before the parameters surely exist on their owners (each owner looks them up at the first step).
      DistributedOptimizer<torch::optim::SGD> opt(params, torch::optim::SGDOptions(0.1));
      for (auto& p : params) p.to_here().wait(20s);  // scaled_sum's local_value() needs the values made
      da::Context ctx;
      auto x = at::rand({4});
      auto loss = rpc_sync<&scaled_sum>(1, params[0], x) + rpc_sync<&scaled_sum>(2, params[1], x);
      ctx.backward({loss}).wait(20s);
      stop_process(pid);
      auto step = opt.step(ctx);
      ::kill(pid, SIGKILL);
      auto what = EXPECT_THROWS_AS(step.wait(20s), ConnectionError);
      EXPECT(what.find("worker2") != std::string::npos);
    }
    expect_no_contexts_on({0, 1});
    expect_no_references_on({0, 1});
  });
}
