// The holes issue 8 found in the first runtime core, one test each. On that core each of these hung (bounded here by
// the launcher's timeout) or gave a wrong result; the run-to-completion core must pass them all.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <asio.hpp>
#include <thread>

#include "corpc/autograd/dist_autograd.hpp"
#include "raw_peer.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

int add(int a, int b) { return a + b; }
at::Tensor twice(at::Tensor t) { return t * 2; }
at::Tensor size_of(at::Tensor t) { return at::scalar_tensor(static_cast<double>(t.numel())); }
at::Tensor make_big(std::int64_t n) { return at::zeros({n}); }
std::size_t length(std::string s) { return s.size(); }

// Holds a call open until the test says so (bounded by the launcher's timeout).
std::atomic<bool> g_released{false};
int held_until_released() {
  while (!g_released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return 500;
}
void release() { g_released = true; }
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}

// An asynchronous handler whose result cannot be encoded (corpc sends dense tensors only).
Task<at::Tensor> sparse_later() {
  co_await rpc_async<&add>(0, 1, 1);
  co_return at::eye(3).to_sparse();
}

// Runs on the I/O thread (marked below) and tries to block there.
int block_on_io_thread() { return rpc_sync<&add>(0, 1, 2); }

// A pool handler that blocks on a nested call: 32 of these at once must not starve a pool of 4.
int nested_blocking(int i) { return rpc_sync<&sleep_ms>(2, 20) + i; }
std::uint64_t pool_threads_started() { return Runtime::get().stats().pool_threads_started; }

}  // namespace

CORPC_IO_THREAD_FUNCTION(&block_on_io_thread);

TEST_CASE("1: a call whose arguments fail to encode fails alone, and graceful shutdown still completes") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto sparse = at::eye(3).to_sparse();
    auto msg = EXPECT_THROWS_AS(rpc_async<&twice>(1, sparse).wait(30s), UsageError);
    EXPECT(msg.find("dense") != std::string::npos);
    EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
    EXPECT_EQ(Runtime::get().stats().calls_in_flight, 0u);
  });  // run_world's graceful shutdown hangs (until the launcher's timeout) if the failed call stayed counted
}

TEST_CASE("2: an asynchronous handler whose reply fails to encode answers with an error, not a timeout") {
  auto options = quick_options();
  options.rpc_timeout = 120s;  // longer than the launcher allows: only a prompt error passes
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto msg = EXPECT_THROWS_AS(rpc_async<&sparse_later>(1).wait(60s), RemoteError);
    EXPECT(msg.find("dense") != std::string::npos);
    EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
  }, options, 90s);  // and worker1's running-handler count came back to zero, or shutdown would hang
}

TEST_CASE("3: a task spawned on main that blocks after its first co_await does not block the I/O thread") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto task = []() -> Task<int> {
      int a = co_await rpc_async<&add>(1, 1, 1);  // resumes on the worker pool, never on the I/O thread
      co_return rpc_sync<&add>(1, a, 1);          // so blocking here is allowed and cannot deadlock
    };
    auto f = spawn(task());
    EXPECT_EQ(f.wait(30s), 3);
    // Blocking on an I/O thread is refused at once, with a clear error, instead of deadlocking.
    auto msg = EXPECT_THROWS_AS(rpc_sync<&block_on_io_thread>(1), RemoteError);
    EXPECT(msg.find("I/O thread") != std::string::npos);
    EXPECT_EQ(rpc_sync<&add>(1, 2, 2), 4);
  });
}

TEST_CASE("4: replies are accepted only from the connection that carried the request") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto slow = rpc_async<&held_until_released>(1);  // in flight for as long as the forging takes
    // A stranger connects to this worker and answers every plausible request id with a forged value.
    asio::io_context io;
    auto s = authenticated_socket(io, get_worker_info(0));  // even a peer that knows the secret
    Message forged = corpc::detail::encode_reply(7, 0);
    std::string bytes;
    for (std::uint64_t gen = 0; gen < 4; ++gen) {
      for (std::uint64_t idx = 0; idx < 64; ++idx) {
        FrameHeader h;
        h.kind = FrameKind::Response;
        h.id = gen << 32 | idx;
        h.body_len = static_cast<std::uint32_t>(forged.body.size());
        bytes.append(reinterpret_cast<const char*>(&h), sizeof h);
        bytes += forged.body;
      }
    }
    asio::error_code ec;
    asio::write(s, asio::buffer(bytes), ec);
    EXPECT(hung_up(s));
    EXPECT(!slow.done());
    rpc_sync<&release>(1);
    EXPECT_EQ(slow.wait(30s), 500);  // the real answer, from the real peer
  });
}

TEST_CASE("5: the sender checks the receiver's limits before anything is sent; the peer stays alive") {
  auto options = quick_options();
  options.limits.max_tensor_bytes = 1 << 20;
  options.limits.max_body_bytes = 1 << 16;
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto big = at::zeros({(1 << 20) / 4 + 1});  // one float over 1 MiB
    auto msg = EXPECT_THROWS_AS(rpc_async<&size_of>(1, big).wait(30s), MessageTooLargeError);
    EXPECT(msg.find("worker1") != std::string::npos);
    EXPECT_THROWS_AS(rpc_async<&length>(1, std::string(70000, 'x')).wait(30s), MessageTooLargeError);
    EXPECT_EQ(rpc_sync<&length>(1, std::string(60000, 'x')), 60000u);
    // A reply over the caller's limit fails on the callee's side and comes back as an error.
    EXPECT_THROWS_AS(rpc_async<&make_big>(1, (1 << 20) / 4 + 1).wait(30s), RpcError);
    EXPECT(Runtime::get().is_alive(1));
    EXPECT_EQ(rpc_sync<&size_of>(1, at::zeros({16})).item<double>(), 16.0);
    EXPECT_EQ(Runtime::get().stats().calls_in_flight, 0u);
  }, options);
}

TEST_CASE("6: a distributed-autograd context opened in a coroutine stays with the coroutine") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto in_context = []() -> Task<std::int64_t> {
      dist_autograd::Context ctx;
      auto x = at::ones({2}).requires_grad_();
      auto y = co_await rpc_async<&twice>(1, x);  // suspends: resumes on another thread
      EXPECT_EQ(dist_autograd::current_context_id(), ctx.id());
      co_return ctx.id();
    };
    EXPECT(sync_wait(in_context()) >= 0);
    EXPECT_EQ(dist_autograd::current_context_id(), -1);
    EXPECT(spawn(in_context()).wait(30s) >= 0);
    EXPECT_EQ(dist_autograd::current_context_id(), -1);
    // The starter's own calls are outside any context: a plain local backward through their results works.
    auto x = at::ones({2}).requires_grad_();
    auto y = rpc_sync<&twice>(1, x);  // recorded into a leaked context, y's grad_fn would be a recv function
    auto z = (x * 3).sum() + y.sum();
    z.backward();                      // ... and this would throw "RecvFunction is captured, never executed"
    EXPECT(at::allclose(x.grad(), at::full({2}, 3.0)));
  });
}

TEST_CASE("7: handlers blocking on nested calls cannot starve the worker pool") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    std::vector<Future<int>> calls;
    for (int i = 0; i < 32; ++i) calls.push_back(rpc_async<&nested_blocking>(1, i));
    for (int i = 0; i < 32; ++i) EXPECT_EQ(calls[i].wait(60s), 20 + i);
    EXPECT(rpc_sync<&pool_threads_started>(1) > 4u);  // worker1 replaced its blocked threads
  });
}
