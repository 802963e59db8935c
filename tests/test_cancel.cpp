// Cancellation and deadlines over real sockets: a cancelled call stops its callee (before it starts, mid-run, during
// a large transfer), a deadline stops the work on every worker of a chain, and nothing stays counted afterwards.
#include <ATen/ATen.h>
#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"

#include "support.hpp"

namespace test_cancel {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

// ---- callee side: what ran, and whether it saw a stop --------------------------------------------------------------
std::atomic<int> g_started{0};
std::atomic<int> g_stopped{0};  // functions that ended because their call was stopped
std::int64_t g_budget_ms = -1;  // what was left of the deadline when the last chain hop started

int started() { return g_started.load(); }
int stopped() { return g_stopped.load(); }
std::int64_t budget_ms() { return g_budget_ms; }

void hold(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }
void count_start() { ++g_started; }

// Holds the callee's only pool thread until the caller releases it (on the I/O thread, which the held pool thread
// does not block): a test that needs "queued behind busy work" gets it however slow the machine is, where a timed
// hold let a loaded machine run the queued call before its cancel arrived.
std::atomic<bool> g_released{false};
void hold_until_released() {
  for (int i = 0; i < 60000 && !g_released.load(); ++i) std::this_thread::sleep_for(1ms);  // bounded: 60 s
}
void release_hold() { g_released = true; }
}  // namespace
}  // namespace test_cancel
CORPC_IO_THREAD_FUNCTION(&test_cancel::release_hold);
namespace test_cancel {
namespace {

// Parks until its call is stopped, then says so.
Task<void> park() {
  ++g_started;
  static Promise<void> never;
  try {
    co_await never.get_future();
  } catch (const CancelledError&) {
    ++g_stopped;
    throw;
  }
}

// Works on its input for up to 5 s, polling its stop token as a long computation would.
std::int64_t consume(at::Tensor t) {
  ++g_started;
  for (int i = 0; i < 5000; ++i) {
    if (this_call::stop_requested()) {
      ++g_stopped;
      break;
    }
    std::this_thread::sleep_for(1ms);
  }
  return t.numel();
}

// A chain: worker k calls worker k+1 with what is left of the deadline; the last one parks.
Task<void> hop(int next) {
  if (auto d = this_call::deadline()) {
    g_budget_ms = std::chrono::duration_cast<std::chrono::milliseconds>(*d - std::chrono::steady_clock::now()).count();
  }
  ++g_started;
  try {
    if (next < Runtime::get().world_size()) {
      co_await rpc_async<&hop>(next, next + 1);
    } else {
      static Promise<void> never;
      co_await never.get_future();
    }
  } catch (const CancelledError&) {
    ++g_stopped;  // the stop reached this worker
    throw;
  } catch (const TimeoutError&) {
    ++g_stopped;  // the deadline, inherited, expired here first
    throw;
  }
}

at::Tensor big(std::int64_t n) { return at::ones({n}); }

// Polls `probe` on `worker` until it returns `want` (bounded: the test fails rather than hangs).
template <auto Probe, class T>
void eventually(int worker, T want) {
  for (int i = 0; i < 1000; ++i) {
    if (rpc_sync<Probe>(worker) == want) return;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(rpc_sync<Probe>(worker), want);
}

// ---- the runtime's background work (values being created on their owner) ------------------------------------------
std::atomic<int> g_values_live{0};  // Value objects alive in this process
std::atomic<int> g_created{0};      // creations that ran to the end
struct Value {
  Value() { ++g_values_live; }
  Value(const Value&) { ++g_values_live; }
  ~Value() { --g_values_live; }
  int get() const { return 7; }
};
int answer() { return 42; }
// A creation that outlives its acknowledgement and then needs the creator: shutdown must not close under it.
Task<Value> late_value() {
  hold(300);
  EXPECT_EQ(co_await rpc_async<&answer>(0), 42);
  ++g_created;
  co_return Value{};
}
// A creation that only a stop ends.
Task<Value> parked_value() {
  co_await park();
  co_return Value{};
}
int value_of(RRef<Value> r) { return r.rpc_sync<&Value::get>(); }
RRef<Value> g_kept;  // outlives the runtime: a reference still held when shutdown starts

std::uint64_t in_flight() { return Runtime::get().stats().calls_in_flight; }
std::uint64_t handlers() { return Runtime::get().stats().handlers_running - 1; }  // other than this probe

RpcOptions one_pool_thread() {
  auto o = quick_options();
  o.num_worker_threads = 1;
  return o;
}

}  // namespace

TEST_CASE("a call cancelled before it starts is dropped on the callee; its future says cancelled") {
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        auto busy = rpc_async<&hold_until_released>(1);  // takes worker1's only pool thread
        auto queued = rpc_async<&count_start>(1);        // waits in worker1's queue behind it
        queued.cancel();
        EXPECT(queued.done() && queued.cancelled());
        EXPECT_THROWS_AS(queued.wait(), CancelledError);
        rpc_sync<&release_hold>(1);  // after the cancel on the same connection: worker1 has read it
        busy.wait();
        EXPECT_EQ(rpc_sync<&started>(1), 0);  // dropped, never run
        queued.cancel();                      // idempotent
        EXPECT_EQ(in_flight(), 0u);
        eventually<&handlers>(1, std::uint64_t{0});
      },
      one_pool_thread());
}

TEST_CASE("a stop token stops a coroutine function at its next await, on the callee") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    std::stop_source source;
    auto f = rpc_async<&park>(1, with_stop_token(source.get_token()));
    eventually<&started>(1, 1);
    EXPECT(!f.done());
    source.request_stop();
    EXPECT(f.cancelled());
    eventually<&stopped>(1, 1);
    eventually<&handlers>(1, std::uint64_t{0});
    EXPECT_EQ(in_flight(), 0u);
    // The same through the future, and through when_all stopping the rest after a failure.
    std::vector<Future<void>> batch;
    batch.push_back(rpc_async<&park>(1));
    eventually<&started>(1, 2);  // running, not merely queued (a queued call would be dropped, not stopped)
    batch.push_back(make_exceptional_future<void>(std::make_exception_ptr(std::runtime_error("one failed"))));
    auto all = when_all(std::move(batch), WhenAll::stop_rest_on_failure);
    EXPECT_THROWS_AS(all.wait(), std::runtime_error);
    eventually<&stopped>(1, 2);
    eventually<&handlers>(1, std::uint64_t{0});
  });
}

TEST_CASE("cancelling during a large tensor transfer: the callee never runs the work, nothing leaks") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    const std::int64_t n = 32 << 20;  // 128 MiB of floats: the cancel leaves while the request is still in transit
    {
      dist_autograd::Context ctx;  // the cancelled request carries grad-requiring tensors: the context is recorded
      auto t = at::ones({n}).requires_grad_();
      auto f = rpc_async<&consume>(1, t);
      f.cancel();
      EXPECT(f.cancelled());
      // And a large reply being fetched: the RRef's owner keeps exact counts.
      auto ref = remote<&big>(1, n);
      auto fetch = ref.to_here();
      fetch.cancel();
      EXPECT(fetch.cancelled());
    }
    // Either the request was dropped before it ran, or it ran and saw its stop: it never ran unstopped.
    eventually<&handlers>(1, std::uint64_t{0});
    EXPECT_EQ(rpc_sync<&started>(1), rpc_sync<&stopped>(1));
    auto rrefs_live = [] {
      auto s = rref_stats(1).wait();
      return s.owned_values + s.user_references + s.pending_forks;
    };
    for (int i = 0; i < 1000 && rrefs_live() != 0; ++i) std::this_thread::sleep_for(10ms);
    if (const auto owner = rref_stats(1).wait(); owner.owned_values + owner.user_references + owner.pending_forks != 0)
      throw std::runtime_error("worker1 still owns " + std::to_string(owner.owned_values) + " values, holds " +
                               std::to_string(owner.user_references) + " user references and " +
                               std::to_string(owner.pending_forks) + " pending forks");
    // The dropped reference's delete is a call of this worker's own, in flight until the owner answers it.
    for (int i = 0; i < 1000 && in_flight() != 0; ++i) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(in_flight(), 0u);
    for (int i = 0; i < 1000 && dist_autograd::live_contexts(1).wait() != 0; ++i) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(dist_autograd::live_contexts(1).wait(), 0u);
    EXPECT_EQ(dist_autograd::live_contexts(), 0u);
  });
}

TEST_CASE("a deadline travels down a chain of three workers and stops the work on all three") {
  run_world(4, [](int rank) {
    if (rank != 0) return;
    auto f = rpc_async<&hop>(1, with_timeout(400ms), 2);
    EXPECT_THROWS_AS(f.wait(), TimeoutError);
    EXPECT_EQ(rpc_sync<&started>(1), 1);
    for (int w = 1; w <= 3; ++w) {
      // A hop that arrives after the deadline (a loaded machine) is dropped unrun, which stops it too: every hop
      // that started was stopped, and none is left running.
      eventually<&handlers>(w, std::uint64_t{0});
      EXPECT_EQ(rpc_sync<&started>(w), rpc_sync<&stopped>(w));
      if (rpc_sync<&started>(w) == 0) continue;
      const auto left = rpc_sync<&budget_ms>(w);
      EXPECT(left >= 0 && left <= 400);  // inherited, not a fresh default
    }
    EXPECT_EQ(in_flight(), 0u);
  });
}

TEST_CASE("graceful shutdown waits for the runtime's background work, then joins it: nothing is left running") {
  const LaunchOptions lo = launch_options(60s);
  launch_processes(
      2,
      [](int rank) {
        init_rpc(worker_name(rank), rank, 2, quick_options());
        // Acknowledged at once; the value is still being computed (and will call rank 0) when both ranks shut down.
        if (rank == 0) g_kept = remote<&late_value>(1);
        shutdown(true);
        g_kept = {};
        if (rank == 1) {
          EXPECT_EQ(g_created.load(), 1);      // rank 0 stayed until the creation had finished with it
          EXPECT_EQ(g_values_live.load(), 0);  // and the value went with the runtime
        }
      },
      lo);
}

TEST_CASE("a shutdown that does not wait stops the background work and joins it") {
  const LaunchOptions lo = launch_options(60s);
  launch_processes(
      2,
      [](int rank) {
        init_rpc(worker_name(rank), rank, 2, quick_options());
        if (rank == 0) {
          g_kept = remote<&parked_value>(1);
          shutdown(true);  // rank 1 leaves without waiting: that ends this one's wait too
          g_kept = {};
          return;
        }
        for (int i = 0; i < 1000 && started() == 0; ++i) std::this_thread::sleep_for(10ms);
        EXPECT_EQ(started(), 1);
        shutdown(false);
        EXPECT_EQ(stopped(), 1);  // the parked creation saw the stop and unwound before shutdown returned
        EXPECT_EQ(g_values_live.load(), 0);
      },
      lo);
}

TEST_CASE("a remote() whose creation timed out fails every later use, and the creation never runs") {
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        auto busy =
            rpc_async<&hold_until_released>(1);  // holds worker1's only pool thread: the creation waits in its queue
        auto ref = remote<&parked_value>(1, with_timeout(50ms));
        EXPECT_THROWS_AS(ref.state()->confirmed.wait(), TimeoutError);  // the owner did not acknowledge it in time
        EXPECT_THROWS_AS(ref.to_here().wait(), TimeoutError);
        EXPECT_THROWS_AS(ref.rpc_sync<&Value::get>(), TimeoutError);      // a proxy call
        EXPECT_THROWS_AS(rpc_sync<&value_of>(1, ref), TimeoutError);      // passed as an argument
        EXPECT_THROWS_AS((void)ref.remote<&Value::get>(), TimeoutError);  // a creation from it
        EXPECT(!ref.confirmed_by_owner());
        rpc_sync<&release_hold>(1);
        busy.wait();
        EXPECT_EQ(rpc_sync<&started>(1), 0);  // cancelled on the callee before it ran
        ref = {};
        eventually<&handlers>(1, std::uint64_t{0});
        EXPECT_EQ(in_flight(), 0u);
        auto rrefs_live = [](int w) {
          auto s = rref_stats(w).wait();
          return s.owned_values + s.user_references + s.pending_forks;
        };
        for (int i = 0; i < 1000 && rrefs_live(1) != 0; ++i) std::this_thread::sleep_for(10ms);
        EXPECT_EQ(rrefs_live(1), 0u);
        EXPECT_EQ(rrefs_live(0), 0u);
      },
      one_pool_thread());
}

}  // namespace test_cancel
