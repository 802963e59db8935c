// Faults at the phases the other suites do not cover: a worker stopped (SIGSTOP) during a call and during to_here,
// and a worker killed during to_here, a distributed backward and a DistributedOptimizer step. A kill is made
// deterministic by stopping the worker first, starting the phase (its messages are then surely in flight to a frozen
// peer), then killing it. (Covered elsewhere: SIGKILL mid-call, test_rpc; of an RRef owner while its value is being
// made, test_rref; SIGKILL and SIGSTOP during a pipeline step, test_pipeline; of the master, test_rpc.)
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/autograd/optimizer.hpp"
#include "corpc/rref/rref.hpp"

#include "leak_checks.hpp"
#include "stop_process.hpp"
#include "support.hpp"

namespace test_fault_matrix {  // this file's names, apart from the files it shares an executable with

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

namespace {

std::atomic<int> g_rejoin_marks{0};
int mark_rejoin_phase() { return ++g_rejoin_marks; }
int rejoin_marks() { return g_rejoin_marks.load(); }
bool sees_alive(int rank) { return Runtime::get().is_alive(rank); }

// Polls `f` until it returns true (bounded by the launch's timeout).
template <class F>
void until(F&& f) {
  while (!f()) std::this_thread::sleep_for(10ms);
}

// A flag between the ranks of one launch (children of the test process) and rank 1's process outside RPC.
std::string rejoin_flag(int rank) {
  return "/tmp/corpc-rejoin-" + std::to_string(::getppid()) + "-" + std::to_string(rank);
}

}  // namespace

TEST_CASE("a rank killed and started again with RpcOptions::rejoin takes its place: calls both ways, quiet shutdown") {
  // Rank 1's first process takes part and is then killed; the launcher starts it again in place (its restart 1, which
  // rejoins), and once rank 0 and rank 2 have seen it die it takes its place as rank 1's second incarnation.
  LaunchOptions restart_once = launch_options(60s);
  restart_once.max_rank_restarts = 1;
  launch_processes(
      3,
      [](int rank) {
        RpcOptions o = quick_options();
        if (rank == 1 && rank_restart_count() == 0) {
          init_rpc(worker_name(1), 1, 3, o);
          EXPECT_EQ(rpc_sync<&add>(0, 1, 1), 2);
          EXPECT_EQ(rpc_sync<&add>(2, 1, 2), 3);  // rank 2 now has a connection from this incarnation
          rpc_sync<&mark_rejoin_phase>(0);
          ::raise(SIGKILL);
        }
        if (rank == 1) {
          EXPECT(rejoining());
          // A claim is taken only once the predecessor's connection has closed where it is made.
          until([] {
            return ::access(rejoin_flag(0).c_str(), F_OK) == 0 && ::access(rejoin_flag(2).c_str(), F_OK) == 0;
          });
          ::unlink(rejoin_flag(0).c_str());
          ::unlink(rejoin_flag(2).c_str());
          init_rpc(worker_name(1), 1, 3, o);
          EXPECT_EQ(get_worker_info(1).name, "worker1");
          EXPECT_EQ(rpc_sync<&add>(0, 2, 2), 4);
          EXPECT_EQ(rpc_sync<&add>(2, 2, 3), 5);  // rank 2 takes the new incarnation on this first connection
          rpc_sync<&mark_rejoin_phase>(0);
          until([] { return rpc_sync<&rejoin_marks>(0) >= 4; });
          shutdown(true);
          return;
        }
        init_rpc(worker_name(rank), rank, 3, o);
        until([] { return !sees_alive(1); });
        { std::ofstream(rejoin_flag(rank)) << "dead\n"; }
        if (rank == 2) {
          until([] { return rpc_sync<&rejoin_marks>(0) >= 2; });
          EXPECT(sees_alive(1));
          EXPECT_EQ(rpc_sync<&add>(1, 4, 4), 8);  // dialed at the new incarnation's address
          rpc_sync<&mark_rejoin_phase>(0);
        } else {
          until([] { return rejoin_marks() >= 3; });
          EXPECT(sees_alive(1));
          EXPECT_EQ(rpc_sync<&add>(1, 5, 5), 10);
          mark_rejoin_phase();
        }
        shutdown(true);  // quiet: the job lost nothing, the replaced rank's old requests are forgotten
      },
      restart_once);
}

namespace {
// Where rank 2 of the case below tells rank 1's replacement that its call to the dead rank is held.
std::string held_flag() { return "/tmp/corpc-held-" + std::to_string(::getppid()); }
}  // namespace

TEST_CASE("with RpcOptions::replacement_wait a call to a dead rank waits for its new incarnation and reaches it") {
  // Rank 1 dies; rank 2, which has seen it die, calls it. Without a wait that call fails at once ("is gone"); with
  // one it is held, and the replacement starts only once it is: the call is answered by the new incarnation.
  LaunchOptions restart_once = launch_options(60s);
  restart_once.max_rank_restarts = 1;
  launch_processes(
      3,
      [](int rank) {
        RpcOptions o = quick_options();
        o.replacement_wait = 60s;  // the launch's own timeout bounds the case
        if (rank == 1 && rank_restart_count() == 0) {
          init_rpc(worker_name(1), 1, 3, o);
          EXPECT_EQ(rpc_sync<&add>(2, 1, 1), 2);  // rank 2 has met this incarnation
          ::raise(SIGKILL);
        }
        if (rank == 1) {
          until([] { return ::access(held_flag().c_str(), F_OK) == 0 && ::access(rejoin_flag(0).c_str(), F_OK) == 0; });
          ::unlink(held_flag().c_str());
          ::unlink(rejoin_flag(0).c_str());
          init_rpc(worker_name(1), 1, 3, o);
          shutdown(true);
          return;
        }
        init_rpc(worker_name(rank), rank, 3, o);
        until([] { return !sees_alive(1); });
        if (rank == 0) {
          std::ofstream(rejoin_flag(0)) << "dead\n";
        } else {
          auto answer = rpc_async<&add>(1, 20, 22);
          EXPECT(!answer.done());  // held: nothing can answer it until the replacement, which waits for the flag
          std::ofstream(held_flag()) << "held\n";
          EXPECT_EQ(answer.wait(), 42);
          EXPECT(sees_alive(1));
          EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
        }
        shutdown(true);
      },
      restart_once);
}

TEST_CASE(
    "with RpcOptions::replacement_wait a rank that never comes back: TimeoutError at a nearer deadline, "
    "ConnectionError past the wait") {
  RpcOptions o = quick_options();
  o.replacement_wait = 1s;
  expect_only_rank_lost(2, "signal", [&] {
    run_world(
        3,
        [](int rank) {
          if (rank == 2) ::raise(SIGKILL);
          if (rank != 0) return;
          until([] { return !sees_alive(2); });
          auto what = EXPECT_THROWS_AS(rpc_async<&add>(2, with_timeout(100ms), 1, 2).wait(20s), TimeoutError);
          EXPECT_CONTAINS(what, "call to '");
          EXPECT_CONTAINS(what,
                          "timed out after 100 ms, waiting for a new incarnation of the rank: worker 'worker2' "
                          "(rank 2) is gone");
          what = EXPECT_THROWS_AS(rpc_async<&add>(2, 1, 2).wait(20s), ConnectionError);
          EXPECT_CONTAINS(what, "worker 'worker2' (rank 2) is gone: ");
          EXPECT_CONTAINS(what, "no new incarnation took its place within RpcOptions::replacement_wait (1000 ms)");
          EXPECT_EQ(rpc_sync<&add>(1, 2, 2), 4);  // the living are not held up
        },
        o, 60s);
  });
}

}  // namespace test_fault_matrix
