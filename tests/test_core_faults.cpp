// Faults found in earlier runtime cores, one test each. On that core each of these hung (bounded here by
// the launcher's timeout) or gave a wrong result; the run-to-completion core must pass them all. Then exits and ranks:
// peers that hold the secret and claim a rank that is taken, or a rank they cannot prove (a live rank that has not
// dialled yet, as itself or as its replacement; a dead rank's replacement at rank 0), strangers flooding a worker whose
// stderr nobody reads, and a peer announcing a large frame and sending nothing.
#include <ATen/ATen.h>
#include <asio.hpp>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <malloc.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include "corpc/autograd/dist_autograd.hpp"

#include "../src/rpc/hello.hpp"
#include "../src/rpc/runtime_impl.hpp"
#include "raw_peer.hpp"
#include "support.hpp"

namespace test_core_faults {  // this file's names, apart from the files it shares an executable with

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

// ---- exits, duplicate names, late replies ----

std::string whoami() { return get_worker_info().name; }
at::Tensor echo_tensor(at::Tensor t) { return t; }
std::string whoami_via(int rank) { return rpc_sync<&whoami>(rank); }
bool is_alive_here(int rank) { return Runtime::get().is_alive(rank); }
std::string echo(std::string s) { return s; }

// Reads exactly `len` bytes into `p` within 20 s; false on a close, an error or the limit.
bool read_within(asio::io_context& io, asio::ip::tcp::socket& s, void* p, std::size_t len) {
  bool finished = false;
  asio::error_code result;
  asio::async_read(s, asio::buffer(p, len), [&](const asio::error_code& ec, std::size_t) {
    result = ec;
    finished = true;
  });
  return run_until(io, s, finished) && !result;
}

// The header of the next frame the worker sends on `s` (its payload read and dropped), or nothing if the worker closed
// the connection or sent nothing within the limit.
std::optional<corpc::detail::FrameHeader> next_frame(asio::io_context& io, asio::ip::tcp::socket& s) {
  corpc::detail::FrameHeader h;
  if (!read_within(io, s, &h, sizeof h)) return std::nullopt;
  // A sealed connection's frames are followed by their tag (src/transport/frame_seal.hpp): read and dropped here.
  std::string payload(
      std::size_t{h.meta_len} + h.body_len + h.tensor_bytes + (is_sealed(s) ? corpc::detail::FrameSeal::kTagBytes : 0),
      '\0');
  if (!read_within(io, s, payload.data(), payload.size())) return std::nullopt;
  return h;
}

std::string serialized(const corpc::detail::FrameHeader& h, const std::string& body = {}) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof h) + body;
}

// What a process holding the job's secret sends when it claims to be `who`: its Hello, then `after`.
std::string claim(const WorkerInfo& who, int world_size, const std::string& after) {
  corpc::detail::OutFrame hello = corpc::detail::prepare(hello_message(who, world_size, false, WireLimits{}));
  return serialized(hello.head, hello.body) + after;
}

// A Hello claiming `who` that no launcher dealt and no key of `who` signed: a fresh key of its own, a proof of nothing.
// `registering`: sent to rank 0 as a registration; `rejoining`: as the rank's replacement (incarnation 1).
std::string unproven_hello(const WorkerInfo& who, int world_size, bool registering, bool rejoining) {
  corpc::detail::Hello h;
  h.self = who;
  h.world_size = world_size;
  h.registering = registering;
  h.rejoining = rejoining;
  h.incarnation = rejoining ? 1 : 0;
  h.public_key = std::string(32, '\x5a');
  h.proof = std::string(registering ? 32 : 64, '\0');
  corpc::detail::Message m;
  m.head.kind = corpc::detail::FrameKind::Hello;
  m.body = corpc::detail::encode_hello(h);
  corpc::detail::OutFrame f = corpc::detail::prepare(std::move(m));
  return serialized(f.head, f.body);
}

// Expects the worker behind `s` to refuse the claim it was sent: an Error for the connection itself (id 0) as the very
// first frame (no Hello answer, no reply to anything sent after the claim), then the connection closed.
void expect_claim_refused(asio::io_context& io, asio::ip::tcp::socket& s) {
  auto first = next_frame(io, s);
  EXPECT(first.has_value());
  EXPECT_EQ(static_cast<int>(first->kind), static_cast<int>(corpc::detail::FrameKind::Error));
  EXPECT_EQ(first->id, 0u);
  EXPECT(hung_up_within(io, s));
}

std::int64_t rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  std::int64_t kib = 0;
  while (status >> key) {
    if (key == "VmRSS:") {
      status >> kib;
      break;
    }
  }
  return kib * 1024;
}

// On the I/O thread that reads every connection of the worker (one I/O thread): a frame header it had read is acted
// on by then, so the budget it reserved and the memory it took are both in this answer. {bytes reserved, RSS}
std::vector<std::int64_t> held_and_rss() {
  auto& budget = *runtime_impl(Runtime::get()).receive_budget;
  return {static_cast<std::int64_t>(budget.bytes_used()), rss_bytes()};
}

// stderr as a pipe that nobody reads, full before the worker starts: any write to it would block.
class UnreadStderr {
 public:
  UnreadStderr() {
    int p[2];
    EXPECT(::pipe(p) == 0);
    read_end_ = p[0];
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(p[1], STDERR_FILENO);
    ::close(p[1]);
    const int flags = ::fcntl(STDERR_FILENO, F_GETFL);
    ::fcntl(STDERR_FILENO, F_SETFL, flags | O_NONBLOCK);
    const std::string filler(4096, '\0');  // told apart from the log's lines when it is drained
    while (::write(STDERR_FILENO, filler.data(), filler.size()) > 0) {}
    ::fcntl(STDERR_FILENO, F_SETFL, flags);
  }
  // The launcher's own lines (a failure) go where they always went. The pipe stays open: a write still blocked on it
  // would otherwise end the process with SIGPIPE.
  ~UnreadStderr() {
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
  }
  int read_end() const { return read_end_; }

 private:
  int read_end_ = -1, saved_ = -1;
};
std::optional<UnreadStderr> g_unread_stderr;

// Reads the worker's stderr pipe until the refusals' summary (a line containing `summary`) shows up (at most 20 s);
// returns the corpc lines.
std::string drain_stderr_until_summary(std::string summary) {
  const int fd = g_unread_stderr->read_end();
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string text;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (text.find(summary) == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i)
        if (buf[i] != '\0') text += buf[i];
    } else {
      std::this_thread::sleep_for(10ms);
    }
  }
  return text;
}

// Opens `n` connections to `target` and closes each at once: each fails the handshake there. Returns how many connected.
int flood_with_strangers(const WorkerInfo& target, int n) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(target.port);
  addr.sin_addr.s_addr = htonl(asio::ip::make_address_v4(target.host).to_uint());
  int connected = 0;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    timeval limit{2, 0};  // a connect that would wait for a full backlog gives up
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    connected += ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
  }
  return connected;
}

// The name of this worker's same-host channel socket (abstract: no file), as `ss -xlp` shows it to anyone on the host.
std::string shm_socket_here() { return runtime_impl(Runtime::get()).same_host.socket_name(); }

// Opens `n` connections to the abstract Unix socket `name` (with its leading NUL), sends each 64 random bytes and
// closes it: each fails the channel's set-up there. Returns how many connected.
int flood_unix_socket(const std::string& name, int n) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, name.data(), std::min(name.size(), sizeof addr.sun_path));
  const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  int connected = 0;
  char junk[64];
  for (int i = 0; i < n; ++i) {
    for (auto& c : junk) c = static_cast<char>(std::rand());
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    timeval limit{2, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
      ++connected;
      (void)!::write(fd, junk, sizeof junk);
    }
    ::close(fd);
  }
  return connected;
}

std::size_t count_of(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (auto at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

}  // namespace

}  // namespace test_core_faults
CORPC_IO_THREAD_FUNCTION(&test_core_faults::block_on_io_thread);
CORPC_IO_THREAD_FUNCTION(&test_core_faults::held_and_rss);
namespace test_core_faults {

TEST_CASE("a call whose arguments fail to encode fails alone, and graceful shutdown still completes") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto sparse = at::eye(3).to_sparse();
    auto msg = EXPECT_THROWS_AS(rpc_async<&twice>(1, sparse).wait(30s), UsageError);
    EXPECT(msg.find("dense") != std::string::npos);
    EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
    EXPECT_EQ(Runtime::get().stats().calls_in_flight, 0u);
  });  // run_world's graceful shutdown hangs (until the launcher's timeout) if the failed call stayed counted
}

TEST_CASE("an asynchronous handler whose reply fails to encode answers with an error, not a timeout") {
  auto options = quick_options();
  options.rpc_timeout = 120s;  // longer than the launcher allows: only a prompt error passes
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        auto msg = EXPECT_THROWS_AS(rpc_async<&sparse_later>(1).wait(60s), RemoteError);
        EXPECT(msg.find("dense") != std::string::npos);
        EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
      },
      options, 90s);  // and worker1's running-handler count came back to zero, or shutdown would hang
}

TEST_CASE("a task spawned on main that blocks after its first co_await does not block the I/O thread") {
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

TEST_CASE("replies are accepted only from the connection that carried the request") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto slow = rpc_async<&held_until_released>(1);  // in flight for as long as the forging takes
    // A stranger connects to this worker and answers every plausible request id with a forged value.
    asio::io_context io;
    auto s = authenticated_socket(io, get_worker_info(0));  // even a peer that knows the secret
    corpc::detail::Message forged = corpc::detail::encode_reply(7, 0);
    std::string bytes;
    for (std::uint64_t gen = 0; gen < 4; ++gen) {
      for (std::uint64_t idx = 0; idx < 64; ++idx) {
        corpc::detail::FrameHeader h;
        h.kind = corpc::detail::FrameKind::Response;
        h.id = gen << 32 | idx;
        h.body_len = static_cast<std::uint32_t>(forged.body.size());
        bytes.append(reinterpret_cast<const char*>(&h), sizeof h);
        bytes += forged.body;
      }
    }
    asio::error_code ec;
    asio::write(s, asio::buffer(sealed(s, bytes)), ec);
    EXPECT(hung_up(s));
    EXPECT(!slow.done());
    rpc_sync<&release>(1);
    EXPECT_EQ(slow.wait(30s), 500);  // the real answer, from the real peer
  });
}

TEST_CASE("the sender checks the receiver's limits before anything is sent; the peer stays alive") {
  auto options = quick_options();
  options.limits.max_tensor_bytes = 1 << 20;
  options.limits.max_body_bytes = 1 << 16;
  run_world(
      2,
      [](int rank) {
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
      },
      options);
}

TEST_CASE("a distributed-autograd context opened in a coroutine stays with the coroutine") {
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
    z.backward();  // ... and this would throw "RecvFunction is captured, never executed"
    EXPECT(at::allclose(x.grad(), at::full({2}, 3.0)));
  });
}

TEST_CASE("handlers blocking on nested calls cannot starve the worker pool") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    std::vector<Future<int>> calls;
    for (int i = 0; i < 32; ++i) calls.push_back(rpc_async<&nested_blocking>(1, i));
    for (int i = 0; i < 32; ++i) EXPECT_EQ(calls[i].wait(60s), 20 + i);
    EXPECT(rpc_sync<&pool_threads_started>(1) > 4u);  // worker1 replaced its blocked threads
  });
}

// ---- exits, duplicate names, late replies ----

TEST_CASE("a second connection claiming a connected rank is refused; the real rank and shutdown are untouched") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        EXPECT_EQ(rpc_sync<&whoami_via>(2, 1), worker_name(1));  // the real worker2 is connected to worker1
        // A process with the secret claims to be worker2, asks for a function nobody has, and leaves politely.
        asio::io_context io;
        auto s = authenticated_socket(io, get_worker_info(1));
        corpc::detail::FrameHeader unknown;
        unknown.kind = corpc::detail::FrameKind::Request;
        unknown.id = 1;
        unknown.function = 0x5eed;
        corpc::detail::FrameHeader goodbye;
        goodbye.kind = corpc::detail::FrameKind::Goodbye;
        asio::write(s,
                    asio::buffer(sealed(s, claim(get_worker_info(2), 3, serialized(unknown) + serialized(goodbye)))));
        expect_claim_refused(io, s);
        s.close();
        EXPECT(rpc_sync<&is_alive_here>(1, 2));                  // worker1 still counts the real worker2 alive ...
        EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // ... and reaches it
        EXPECT_EQ(rpc_sync<&whoami_via>(2, 1), worker_name(1));  // the real worker2's own connection still works
      },
      quick_options(), 60s);  // and the graceful shutdown balances: the refused request counted for nobody
}

TEST_CASE("a claim for a live rank that has not dialled yet, as itself or as its replacement, needs its key") {
  // worker2 has never dialled worker1. A process with the secret claims to be worker2 to worker1, plainly and then as
  // its new incarnation, and hangs up: worker1 must refuse both (it used to answer the first, and to take the second
  // as worker2's replacement), and neither the claims nor their connections' ends may change what it knows of worker2.
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        for (const bool rejoining : {false, true}) {
          asio::io_context io;  // one per connection: the helpers run it until they are done
          auto s = authenticated_socket(io, get_worker_info(1));
          asio::write(s, asio::buffer(sealed(s, unproven_hello(get_worker_info(2), 3, false, rejoining))));
          expect_claim_refused(io, s);
          s.close();
        }
        EXPECT(rpc_sync<&is_alive_here>(1, 2));
        EXPECT_EQ(rpc_sync<&whoami_via>(2, 1), worker_name(1));  // the real worker2's first dial is taken ...
        EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // ... and worker1 reaches it
      },
      quick_options(), 60s);
}

namespace {
// Where rank 2 of the case below tells rank 1's replacement that its forgery was answered (children of one launcher).
std::string forged_flag() { return "/tmp/corpc-forged-" + std::to_string(::getppid()); }
}  // namespace

TEST_CASE("a dead rank's replacement is taken only with the launcher's credential for it; a forger is refused") {
  // Rank 1 dies; before the launcher's replacement registers, rank 2 (holding the job's secret, as a buggy rank or a
  // second job with the same CORPC_SECRET would) registers with rank 0 as rank 1's replacement. Rank 0 used to admit
  // it and take its answers as rank 1's; it must refuse it, then admit the real replacement, whose answers are right
  // and whose connections to the other ranks are taken on rank 0's word (its certificate).
  LaunchOptions restart_once = launch_options(90s);
  restart_once.max_rank_restarts = 1;
  launch_processes(
      3,
      [](int rank) {
        if (rank == 1 && rank_restart_count() > 0) {
          while (::access(forged_flag().c_str(), F_OK) != 0) std::this_thread::sleep_for(10ms);
        }
        init_rpc(worker_name(rank), rank, 3, quick_options());
        if (rank == 1 && rank_restart_count() == 0) ::raise(SIGKILL);
        if (rank == 2) {
          while (rpc_sync<&is_alive_here>(0, 1)) std::this_thread::sleep_for(10ms);
          asio::io_context io;
          auto s = authenticated_socket(io, get_worker_info(0));
          asio::write(s, asio::buffer(sealed(s, unproven_hello(get_worker_info(1), 3, true, true))));
          expect_claim_refused(io, s);
          s.close();
          std::ofstream(forged_flag()) << "refused\n";
        }
        if (rank == 0) {
          while (is_alive_here(1)) std::this_thread::sleep_for(10ms);
          while (!is_alive_here(1)) std::this_thread::sleep_for(10ms);
          EXPECT_EQ(rpc_sync<&add>(1, 20, 22), 42);                // the real replacement answers
          EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // its dial to rank 2, on rank 0's certificate
          EXPECT_EQ(rpc_sync<&whoami_via>(2, 1), worker_name(1));
          ::unlink(forged_flag().c_str());
        }
        shutdown(true);
      },
      restart_once);
}

TEST_CASE("replies forged on a claimed rank's behalf close only the claimant; the real rank's calls go on") {
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        auto slow = rpc_async<&held_until_released>(1);  // the real worker1 has a call of ours in flight
        // A process with the secret claims to be worker1 to us and answers request ids it was never sent.
        asio::io_context io;
        auto s = authenticated_socket(io, get_worker_info(0));
        corpc::detail::Message forged = corpc::detail::encode_reply(7, 0);
        std::string replies;
        for (std::uint64_t idx = 0; idx < 64; ++idx) {
          corpc::detail::FrameHeader h;
          h.kind = corpc::detail::FrameKind::Response;
          h.id = idx;
          h.body_len = static_cast<std::uint32_t>(forged.body.size());
          replies += serialized(h, forged.body);
        }
        asio::write(s, asio::buffer(sealed(s, claim(get_worker_info(1), 2, replies))));
        expect_claim_refused(io, s);
        s.close();
        EXPECT(Runtime::get().is_alive(1));
        EXPECT(!slow.done());
        rpc_sync<&release>(1);
        EXPECT_EQ(slow.wait(30s), 500);  // the real answer, from the real peer
        EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
      },
      quick_options(), 60s);
}

// Rank 0 runs `flood` against rank 1, whose stderr nobody reads. Rank 1 must still answer, and its log hold at most
// RefusalLog::kInFull (src/core/refusal_log.hpp) lines containing `refusal` and a summary containing `summary`;
// `then` runs last on rank 0. Both ranks then shut down gracefully.
void expect_flood_summarised(const std::function<void()>& flood, const std::string& refusal, const std::string& summary,
                             const std::function<void()>& then = {}) {
  launch_processes(
      2,
      [&](int rank) {
        if (rank == 1) g_unread_stderr.emplace();
        init_rpc(worker_name(rank), rank, 2, quick_options());
        if (rank == 0) {
          flood();
          // A worker whose I/O thread blocked on its log misses this deadline (and, 15 s on, is declared unreachable).
          EXPECT_EQ(rpc_async<&add>(1, with_timeout(10s), 2, 3).wait(20s), 5);
          EXPECT_EQ(rpc_async<&whoami>(1, with_timeout(10s)).wait(20s), worker_name(1));
          // Its log: a few refusals in full, the rest in a summary.
          const auto log = rpc_async<&drain_stderr_until_summary>(1, with_timeout(40s), summary).wait(60s);
          EXPECT(count_of(log, refusal) <= 5);
          EXPECT_CONTAINS(log, summary);
          if (then) then();
        }
        shutdown(true);
        g_unread_stderr.reset();
      },
      launch_options(120s));
}

TEST_CASE("strangers flooding a worker whose stderr nobody reads: it answers, summarises, and shuts down") {
  constexpr int kStrangers = 2000;
  expect_flood_summarised([] { EXPECT(flood_with_strangers(get_worker_info(1), kStrangers) > kStrangers / 2); },
                          "refused a connection", "more connections refused");
}

TEST_CASE("strangers flooding a worker's same-host channel socket: a few lines and a summary, and it still answers") {
  constexpr int kStrangers = 1000;
  expect_flood_summarised([] { EXPECT(flood_unix_socket(rpc_sync<&shm_socket_here>(1), kStrangers) > kStrangers / 2); },
                          "refused a set-up", "more set-ups refused on its Unix socket",
                          [] {
                            // The job's own channel is untouched: a large tensor still goes through it both ways.
                            const at::Tensor big = at::arange(1 << 20, at::kFloat);
                            EXPECT(at::equal(rpc_sync<&echo_tensor>(1, big), big));
                          });
}

TEST_CASE("a peer announcing a large frame and sending nothing commits no memory on the receiver") {
  constexpr std::int64_t kMiB = 1 << 20;
  constexpr std::uint32_t kBody = 512 * kMiB;
  constexpr std::uint32_t kMeta = 60 * kMiB;
  constexpr std::int64_t kTensor = 512 * kMiB;
  auto options = quick_options();
  options.num_io_threads = 1;  // held_and_rss sees every connection's reads in order
  // `meson test` sets MALLOC_PERTURB_, with which glibc fills every allocation and so commits it: measure corpc's
  // own behaviour, as a program that does not set it sees it.
  ::mallopt(M_PERTURB, 0);
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        const auto before = rpc_sync<&held_and_rss>(1);
        asio::io_context io;
        // Each announces a large request and sends none of what it announced: a body, a tensor table, tensor data.
        auto body_only = authenticated_socket(io, get_worker_info(1));
        corpc::detail::FrameHeader h;
        h.kind = corpc::detail::FrameKind::Request;
        h.id = 1;
        h.body_len = kBody;
        asio::write(body_only, asio::buffer(sealed(body_only, serialized(h))));
        auto meta_only = authenticated_socket(io, get_worker_info(1));
        h = corpc::detail::FrameHeader{};
        h.kind = corpc::detail::FrameKind::Request;
        h.id = 1;
        h.num_tensors = 1;
        h.meta_len = kMeta;
        h.tensor_bytes = 4;
        asio::write(meta_only, asio::buffer(sealed(meta_only, serialized(h))));
        auto data_only = authenticated_socket(io, get_worker_info(1));
        corpc::detail::Message m;
        m.head.id = 1;
        m.tensors.push_back(at::empty({kTensor / 4}));  // never touched here either
        corpc::detail::OutFrame tensor_frame = corpc::detail::prepare(std::move(m));
        asio::write(data_only,
                    std::array<asio::const_buffer, 2>{asio::buffer(&tensor_frame.head, sizeof tensor_frame.head),
                                                      asio::buffer(tensor_frame.meta)});
        const std::int64_t announced = kBody + kMeta + kTensor;
        std::vector<std::int64_t> now;
        const auto deadline = std::chrono::steady_clock::now() + 30s;
        do {
          now = rpc_sync<&held_and_rss>(1);
        } while (now[0] - before[0] < announced && std::chrono::steady_clock::now() < deadline);
        MESSAGE("announced " << announced / kMiB << " MiB, reserved " << (now[0] - before[0]) / kMiB
                             << " MiB, the receiver's RSS grew by " << (now[1] - before[1]) / kMiB << " MiB");
        EXPECT(now[0] - before[0] >= announced);  // all three headers were read and acted on
        EXPECT(now[1] - before[1] < 32 * kMiB);
        // The real traffic still works, large bodies and tensors included, byte for byte.
        std::string large(5 * kMiB + 17, 'x');
        for (std::size_t i = 0; i < large.size(); i += 4093) large[i] = static_cast<char>('a' + i % 26);
        EXPECT(rpc_sync<&echo>(1, large) == large);
        const auto t = at::arange(4 * kMiB, at::kFloat);
        EXPECT(at::equal(rpc_sync<&twice>(1, t), t * 2));
        EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
      },
      options, 90s);
}

}  // namespace test_core_faults
