// Remote references over real sockets: creation, the fork scenarios, deletion, failures, serialized objects.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <signal.h>
#include <torch/nn/modules/linear.h>

#include <thread>

#include "corpc/rref/remote_module.hpp"
#include "corpc/rref/rref.hpp"

#include "leak_checks.hpp"
#include "support.hpp"

namespace test_rref {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

int square(int x) { return x * x; }
int slow_square(int x) {
  std::this_thread::sleep_for(200ms);
  return x * x;
}
int very_slow(int x) {
  std::this_thread::sleep_for(3s);
  return x;
}
int explode(int) { throw std::domain_error("cannot make this value"); }
at::Tensor ones(std::int64_t n) { return at::ones({n}); }

// Reads a reference on whichever worker it lands; on the owner it is the owner's own handle.
Task<int> read_ref(RRef<int> r) { co_return co_await r.to_here(); }
bool is_owner_here(RRef<int> r) { return r.is_owner(); }
RRef<int> own_value(int v) { return RRef<int>(v); }  // owner -> user, as a result
RRef<int> pass_back(RRef<int> r) { return r; }       // a user hands the reference on
Task<int> add_refs(RRef<int> a, RRef<int> b) { co_return (co_await a.to_here()) + (co_await b.to_here()); }
int plus_one_of(RRef<int> r) { return r.to_here().wait() + 1; }
Task<int> plus_one_async(RRef<int> r) { co_return (co_await r.to_here()) + 1; }

RRef<int> g_kept;  // a reference a worker keeps past the call that brought it
void keep(RRef<int> r) { g_kept = r; }
void drop_kept() { g_kept = RRef<int>(); }

struct Counter {
  explicit Counter(int start) : value(start) {}
  int value;
  int get() const { return value; }
  int add(int d) { return value += d; }
};

// Yields between read and write: without serialization, concurrent calls would lose updates.
struct UnlockedCounter {
  static constexpr bool corpc_serialized_calls = true;
  explicit UnlockedCounter(int start) : value(start) {}
  int value;
  Task<int> increment() {
    int seen = value;
    co_await rpc_async<&square>(get_worker_info().rank == 1 ? 2 : 1, 2);  // suspend mid-update
    value = seen + 1;
    co_return value;
  }
  int get() const { return value; }
};

// ---- RRef bookkeeping beside a link at RpcOptions::max_calls_in_flight_per_peer ----
Promise<void> g_release;
Task<int> hold_until_released() {
  co_await g_release.get_future();
  co_return 1;
}
int take_own(RRef<int> r) { return r.is_owner() ? 1 : 0; }  // on the owner: tells the sender it has it back
Task<int> give_back(RRef<int> r) {
  const int owned = co_await rpc_async<&take_own>(0, r);
  g_release.set_value();
  co_return owned;
}
Task<int> relay_to_1(RRef<int> r) { co_return co_await rpc_async<&give_back>(1, r); }

}  // namespace

TEST_CASE("remote() returns at once; to_here, owner and local_value behave") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    {
      RRef<int> r = remote<&slow_square>("worker1", 7);
      EXPECT_EQ(r.owner_name(), "worker1");
      EXPECT_EQ(r.owner().rank, 1);
      EXPECT(!r.is_owner());
      EXPECT_EQ(r.to_here().wait(10s), 49);
      EXPECT(r.confirmed_by_owner());
      EXPECT_THROWS_AS(r.local_value(), UsageError);
      EXPECT_EQ(sync_wait([](RRef<int> x) -> Task<int> { co_return co_await x.to_here(); }(r)), 49);

      RRef<int> mine(5);
      EXPECT(mine.is_owner());
      EXPECT_EQ(mine.local_value(), 5);
      EXPECT_EQ(mine.to_here().wait(), 5);

      auto t = remote<&ones>(2, 4);
      EXPECT(at::equal(t.to_here().wait(10s), at::ones({4})));

      auto self_made = remote<&square>(0, 3);  // remote() to ourselves, then shared with others
      EXPECT_EQ(self_made.to_here().wait(10s), 9);
      EXPECT_EQ(rpc_sync<&read_ref>("worker1", self_made), 9);
      EXPECT_EQ(rpc_sync<&read_ref>(0, self_made), 9);
    }
    expect_no_references(3);
  });
}

TEST_CASE("every fork scenario shares the value and frees it when the last reference goes") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    {
      auto r = remote<&square>("worker1", 6);
      // user -> owner (as an argument): the owner sees its own handle
      EXPECT(rpc_sync<&is_owner_here>("worker1", r));
      EXPECT_EQ(rpc_sync<&read_ref>("worker1", r), 36);
      // user -> user (third party), which reads it from the owner
      EXPECT(!rpc_sync<&is_owner_here>("worker2", r));
      EXPECT_EQ(rpc_sync<&read_ref>("worker2", r), 36);
      // the third party keeps it after we drop ours: the value must stay alive
      rpc_sync<&keep>("worker2", r);
    }
    // owner -> user (as a result), then user -> user -> back to us
    {
      RRef<int> from_owner = rpc_sync<&own_value>("worker2", 11);
      EXPECT_EQ(from_owner.owner_name(), "worker2");
      EXPECT_EQ(from_owner.to_here().wait(10s), 11);
      RRef<int> bounced = rpc_sync<&pass_back>("worker1", from_owner);
      EXPECT_EQ(bounced.to_here().wait(10s), 11);
      // a reference passed back to its owner, as an argument and as a result
      RRef<int> at_owner = rpc_sync<&pass_back>("worker2", bounced);
      EXPECT_EQ(at_owner.to_here().wait(10s), 11);
      // our own values, shared out and back
      RRef<int> local(3);
      EXPECT_EQ(rpc_sync<&add_refs>("worker1", local, from_owner), 14);
      RRef<int> same = rpc_sync<&pass_back>("worker2", local);
      EXPECT(same.is_owner());
      EXPECT_EQ(same.local_value(), 3);
    }
    // The value kept by worker2 is still alive on worker1 ...
    auto s1 = rref_stats("worker1").wait(10s);
    EXPECT_EQ(s1.owned_values, 1u);
    // ... until worker2 lets go of it.
    rpc_sync<&drop_kept>("worker2");
    expect_no_references(3);
  });
}

TEST_CASE("chains of remote() whose inputs are still being computed need no round trip through the caller") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    {
      auto a = remote<&slow_square>("worker1", 3);     // still computing for 200 ms
      auto b = remote<&plus_one_async>("worker2", a);  // worker2 waits for it on worker1
      auto c = remote<&plus_one_of>("worker1", b);     // and worker1 for that one on worker2
      auto d = remote<&add_refs>("worker2", c, a);
      EXPECT_EQ(d.to_here().wait(20s), 11 + 9);
    }
    expect_no_references(3);
  });
}

TEST_CASE("a failed creation surfaces on the reference's next use") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      auto bad = remote<&explode>("worker1", 1);
      auto msg = EXPECT_THROWS_AS(bad.to_here().wait(10s), RemoteError);
      EXPECT(msg.find("cannot make this value") != std::string::npos);
      auto downstream = remote<&plus_one_async>("worker1", bad);
      EXPECT_THROWS_AS(downstream.to_here().wait(10s), RemoteError);
      EXPECT_THROWS_AS(remote<&square>("nobody", 1), UnknownWorkerError);
    }
    expect_no_references(2);
  });
}

TEST_CASE("proxies call methods of a remote object; serialized objects take one call at a time") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    {
      auto counter = remote<Counter>("worker1", 10);
      EXPECT_EQ(counter.rpc_sync<&Counter::add>(5), 15);
      EXPECT_EQ(counter.rpc_async<&Counter::get>().wait(10s), 15);
      RRef<int> kept = counter.remote<&Counter::add>(1);
      EXPECT_EQ(kept.owner_name(), "worker1");
      EXPECT_EQ(kept.to_here().wait(10s), 16);

      auto shared = remote<UnlockedCounter>("worker1", 0);
      std::vector<Future<int>> calls;
      for (int i = 0; i < 100; ++i) calls.push_back(shared.rpc_async<&UnlockedCounter::increment>());
      when_all(std::move(calls)).wait(60s);
      EXPECT_EQ(shared.rpc_sync<&UnlockedCounter::get>(), 100);  // no update lost without any lock
    }
    expect_no_references(3);
  });
}

TEST_CASE("thousands of references created, shared and dropped concurrently leak nothing") {
  run_world(3, [](int rank) {
    {
      std::vector<RRef<int>> refs;
      std::vector<Future<int>> reads;
      for (int i = 0; i < 1000; ++i) {
        refs.push_back(remote<&square>((rank + 1 + i % 2) % 3, i));
        reads.push_back(rpc_async<&read_ref>((rank + 2) % 3, refs.back()));  // third party or owner
      }
      auto values = when_all(std::move(reads)).wait(60s);
      for (int i = 0; i < 1000; ++i) EXPECT_EQ(values[i], i * i);
    }
    if (rank == 0) {
      std::this_thread::sleep_for(200ms);  // let every rank drop its references
      expect_no_references(3);
    }
  });
}

TEST_CASE("a dead owner fails every waiting use with ConnectionError") {
  expect_only_rank_lost(1, "", [&] {
    run_world(3, [](int rank) {
      if (rank == 2) return;
      if (rank == 1) {
        std::this_thread::sleep_for(300ms);
        ::raise(SIGKILL);
      }
      auto r = remote<&very_slow>("worker1", 2);             // worker1 dies long before this is ready
      auto waiting = remote<&plus_one_async>("worker2", r);  // worker2 waits on the doomed owner
      std::this_thread::sleep_for(600ms);
      EXPECT_THROWS_AS(r.to_here().wait(20s), ConnectionError);
      EXPECT_THROWS_AS(waiting.to_here().wait(20s), RemoteError);  // worker2's wait failed with ConnectionError
      EXPECT_THROWS_AS(r.to_here().wait(20s), ConnectionError);
    });
  });
}

TEST_CASE("RemoteModule's forward equals the local module's forward") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      RemoteModule<torch::nn::Linear> remote_lin("worker1/cpu", 4, 3);
      auto params = remote_lin.remote_parameters();
      EXPECT_EQ(params.size(), 2u);
      // Build the same module here from the remote weights, and compare outputs.
      torch::nn::Linear local(torch::nn::LinearOptions(4, 3));
      {
        torch::NoGradGuard no_grad;
        local->weight.copy_(params[0].to_here().wait(10s));
        local->bias.copy_(params[1].to_here().wait(10s));
      }
      auto x = at::rand({5, 4});
      EXPECT(at::allclose(remote_lin.forward(x), local->forward(x)));
      EXPECT(at::allclose(remote_lin.forward_async(x).wait(10s), local->forward(x)));
      EXPECT_EQ(remote_lin.module_rref().owner_name(), "worker1");
    }
    expect_no_references(2);
  });
}

TEST_CASE("RRef bookkeeping on a link at the per-peer limit does not block the handler that sent it") {
  // Rank 0 takes the only room on its link to rank 1 with a call that ends when rank 1's give_back ends; give_back
  // hands rank 0 its own reference back, and rank 0, decoding it in take_own, tells rank 1 it has it (a control
  // message to rank 1). Had that message waited for room, it would have blocked take_own's thread until the first
  // call timed out: a cycle through one full link.
  auto options = quick_options();
  options.max_calls_in_flight_per_peer = 1;
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        RRef<int> mine(7);
        auto held = rpc_async<&hold_until_released>(1);  // the only room on 0 -> 1
        EXPECT_EQ(rpc_sync<&relay_to_1>(2, mine), 1);    // 0 -> 2 -> 1 -> 0: nested calls, exempt
        EXPECT_EQ(held.wait(), 1);
        EXPECT_EQ(mine.to_here().wait(10s), 7);
      },
      options);
}

}  // namespace test_rref
