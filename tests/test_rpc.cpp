// RPC over real sockets: every test forks real worker processes that talk over 127.0.0.1.
#include <ATen/ATen.h>
#include <asio.hpp>
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <system_error>
#include <thread>

#include "raw_peer.hpp"
#include "stop_process.hpp"
#include "support.hpp"

namespace test_rpc {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

struct Point {
  double x = 0, y = 0;
  std::string label;
  bool operator==(const Point&) const = default;
  CORPC_FIELDS(x, y, label)
};
std::ostream& operator<<(std::ostream& os, const Point& p) { return os << p.label; }

int add(int a, int b) { return a + b; }
std::string greet(const std::string& who) { return "hello " + who; }
void nothing() {}
template <class T>
T echo(T v) {
  return v;
}
at::Tensor echo_tensor(at::Tensor t) { return t; }
std::vector<at::Tensor> echo_tensors(std::vector<at::Tensor> ts) { return ts; }
std::tuple<bool, std::vector<std::int64_t>, std::vector<std::int64_t>> describe(at::Tensor t) {
  return {t.requires_grad(), t.sizes().vec(), t.strides().vec()};
}
int fail_with(std::string message) { throw std::invalid_argument(message); }
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
int die_now() {
  ::raise(SIGKILL);
  return 0;
}
std::string whoami() { return get_worker_info().name; }
std::string whoami_via(int rank) { return rpc_sync<&whoami>(rank); }

// A chain A -> B -> C as coroutines: none holds a thread while it waits.
Task<std::string> relay(std::vector<std::string> path) {
  if (path.empty()) co_return get_worker_info().name;
  auto next = path.front();
  path.erase(path.begin());
  std::string rest = co_await rpc_async<&relay>(next, path);
  co_return get_worker_info().name + ">" + rest;
}

// Calls back into the caller's worker: deadlocks if awaiting held the worker's only thread.
Task<int> call_back_into(std::string origin) {
  int v = co_await rpc_async<&add>("worker2", 1, 1);
  int w = co_await rpc_async<&add>(origin, v, 1);
  co_return w;
}
Task<int> ask_worker1_to_call_back() {
  co_return co_await rpc_async<&call_back_into>("worker1", std::string("worker1"));
}

// A coroutine taking its parameters by reference: they must outlive its suspension.
Task<std::size_t> length_after_hop(const std::string& s, const std::vector<int>& v) {
  co_await rpc_async<&nothing>(0);
  co_return s.size() + v.size();
}

Future<int> future_result(int v) { return make_ready_future(v * 2); }

int process_id() { return static_cast<int>(::getpid()); }

// This process's sockets, asked of each of its descriptors (not read from /proc/net: the kernel lists those tables a
// page at a time, and on a busy host, whose connections come and go between pages, a row may come twice or not at all):
// TCP connections that are established, and Unix stream sockets that are connected (a worker's connections to peers on
// its host, when it takes the Unix socket).
struct SocketCensus {
  // Established TCP connections we dialed to one of the ports asked about: (local port, remote port).
  std::vector<std::pair<std::uint16_t, std::uint16_t>> dialed;
  int unix_connected = 0;
  std::string tcp;  // every established TCP connection, "local port->remote port", for failure messages
};
SocketCensus own_sockets(const std::vector<std::uint16_t>& dialed_ports = {}) {
  const auto int_option = [](int fd, int option) {
    int value = -1;
    socklen_t size = sizeof value;
    return ::getsockopt(fd, SOL_SOCKET, option, &value, &size) == 0 ? value : -1;
  };
  const auto port_of = [](const sockaddr_storage& a) {
    return ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6&>(a).sin6_port
                                         : reinterpret_cast<const sockaddr_in&>(a).sin_port);
  };
  const std::uint16_t own_port = get_worker_info().port;
  SocketCensus census;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::stoi(entry.path().filename().string());
    const int domain = int_option(fd, SO_DOMAIN);  // -1: not a socket (or closed since the listing)
    if (int_option(fd, SO_TYPE) != SOCK_STREAM) continue;
    sockaddr_storage local{}, remote{};
    socklen_t local_size = sizeof local, remote_size = sizeof remote;
    const bool connected = ::getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &remote_size) == 0;
    if (domain == AF_UNIX) {
      census.unix_connected += connected;
      continue;
    }
    tcp_info info{};
    socklen_t info_size = sizeof info;
    if ((domain != AF_INET && domain != AF_INET6) || !connected ||
        ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &info_size) != 0 || info.tcpi_state != TCP_ESTABLISHED ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0)
      continue;
    const std::uint16_t from = port_of(local), to = port_of(remote);
    // One we accepted has our own port at our end, whatever port the dialer's end happens to have.
    if (from != own_port && std::find(dialed_ports.begin(), dialed_ports.end(), to) != dialed_ports.end())
      census.dialed.emplace_back(from, to);
    census.tcp += " " + std::to_string(from) + "->" + std::to_string(to);
  }
  return census;
}

// A count the test expects, failing with what it saw.
void expect_count(int got, int want, const std::string& what) {
  if (got != want)
    throw std::runtime_error(what + ": " + std::to_string(got) + " where " + std::to_string(want) + " were expected");
}

// Our established TCP connections to `rank`'s port (every other rank's, for -1): the ones we dialed, as
// "local port->remote port (rank)". Connections opened to us do not count, whoever opened them: on a busy host another
// job's ranks may dial a stale port that is ours now, until we refuse them.
std::vector<std::string> own_tcp_to(int rank) {
  std::map<std::uint16_t, int> rank_at;
  for (const auto& w : get_worker_infos())
    if (w.rank != get_worker_info().rank && (rank < 0 || w.rank == rank)) rank_at[w.port] = w.rank;
  std::vector<std::uint16_t> ports;
  for (const auto& [port, r] : rank_at) ports.push_back(port);
  std::vector<std::string> dialed;
  for (const auto& [local, remote] : own_sockets(ports).dialed)
    dialed.push_back(std::to_string(local) + "->" + std::to_string(remote) + " (rank " +
                     std::to_string(rank_at[remote]) + ")");
  return dialed;
}

// `dialed` (own_tcp_to) has `want` connections, or the test fails naming them.
void expect_dialed(const std::vector<std::string>& dialed, std::size_t want, const std::string& what) {
  std::string seen;
  for (const auto& d : dialed) seen += " " + d;
  expect_count(static_cast<int>(dialed.size()), static_cast<int>(want), what + " (seen:" + seen + ")");
}

// Whether one process may hold a full Unix listen backlog of connections (the kernel's somaxconn of them, plus the
// rest it uses) once it raises its descriptor limit to the hard one.
bool can_fill_a_backlog() {
  std::ifstream in("/proc/sys/net/core/somaxconn");
  long backlog = 0;
  rlimit files{};
  if (!(in >> backlog) || ::getrlimit(RLIMIT_NOFILE, &files) != 0) return false;
  return files.rlim_max == RLIM_INFINITY || static_cast<long>(files.rlim_max) >= backlog + 512;
}

// Connects to the abstract socket `name` without blocking until the kernel refuses (its backlog is full: its owner
// is stopped), and returns the queued connections' descriptors.
std::vector<int> fill_backlog(const std::string& name) {
  rlimit files{};
  ::getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = files.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &files);
  sockaddr_un at{};
  at.sun_family = AF_UNIX;
  std::memcpy(at.sun_path + 1, name.data(), name.size());
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  std::vector<int> queued;
  for (;;) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::system_error(errno, std::generic_category(), "socket");
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&at), length) == 0) {
      queued.push_back(fd);
      continue;
    }
    const int error = errno;
    ::close(fd);
    if (error == EAGAIN) return queued;
    throw std::system_error(error, std::generic_category(), "connect to a stopped worker's Unix socket");
  }
}

// Run on the I/O thread that reads their request (marked below, at global scope).
int add_on_io(int a, int b) { return a + b; }
Task<std::string> relay_on_io(std::vector<std::string> path) {
  if (path.empty()) co_return get_worker_info().name;
  auto next = path.front();
  path.erase(path.begin());
  std::string rest = co_await rpc_async<&relay_on_io>(next, path);  // resumes on the same I/O thread
  co_return get_worker_info().name + ">" + rest;
}

}  // namespace

// The name the system knows the running thread by (top -H, perf, gdb).
std::string thread_name() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof name);
  return name;
}
std::string io_thread_name() { return thread_name(); }
}  // namespace test_rpc
CORPC_IO_THREAD_FUNCTION(&test_rpc::add_on_io);
CORPC_IO_THREAD_FUNCTION(&test_rpc::relay_on_io);
CORPC_IO_THREAD_FUNCTION(&test_rpc::io_thread_name);
namespace test_rpc {

TEST_CASE("rpc_sync and rpc_async reach every worker by name, rank and WorkerInfo") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
    EXPECT_EQ(rpc_sync<&add>("worker2", 2, 3), 5);
    EXPECT_EQ(rpc_sync<&add>(get_worker_info("worker1"), 2, 3), 5);
    EXPECT_EQ(rpc_async<&greet>("worker1", "you").wait(), "hello you");
    EXPECT_EQ(rpc_sync<&add>(0, 4, 4), 8);  // to ourselves, through the same encoding
    EXPECT_EQ(rpc_sync<&whoami>(2), "worker2");
    rpc_sync<&nothing>(1);
    EXPECT_EQ(rpc_sync<&future_result>(1, 21), 42);
    EXPECT_EQ(rpc_sync<&length_after_hop>(2, std::string(1000, 'x'), std::vector<int>(24, 1)), 1024u);
    auto infos = get_worker_infos();
    EXPECT_EQ(infos.size(), 3u);
    EXPECT_EQ(infos[2].name, "worker2");
    EXPECT_EQ(get_worker_info(1).name, "worker1");
  });
}

TEST_CASE("every supported argument type round-trips") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    EXPECT_EQ(rpc_sync<&echo<std::int8_t>>(1, std::int8_t{-7}), -7);
    EXPECT_EQ(rpc_sync<&echo<std::uint64_t>>(1, std::uint64_t{1} << 63), std::uint64_t{1} << 63);
    EXPECT_EQ(rpc_sync<&echo<double>>(1, 2.5), 2.5);
    EXPECT_EQ(rpc_sync<&echo<bool>>(1, true), true);
    EXPECT_EQ(rpc_sync<&echo<std::string>>(1, std::string(100000, 'x')).size(), 100000u);
    EXPECT(rpc_sync<&echo<std::vector<int>>>(1, std::vector<int>{1, 2, 3}) == (std::vector<int>{1, 2, 3}));
    EXPECT(rpc_sync<&echo<std::optional<std::string>>>(1, std::nullopt) == std::nullopt);
    using Tup = std::tuple<int, std::string, std::pair<float, bool>>;
    EXPECT(rpc_sync<&echo<Tup>>(1, Tup{1, "a", {2.f, true}}) == (Tup{1, "a", {2.f, true}}));
    using Map = std::map<std::string, std::vector<double>>;
    EXPECT(rpc_sync<&echo<Map>>(1, Map{{"k", {1.0}}}) == (Map{{"k", {1.0}}}));
    EXPECT_EQ(rpc_sync<&echo<Point>>(1, Point{1, 2, "p"}), (Point{1, 2, "p"}));
    EXPECT(rpc_sync<&echo<WorkerInfo>>(1, get_worker_info()) == get_worker_info());
  });
}

TEST_CASE("tensors keep dtype, shape, strides and requires_grad; views send only their elements") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kByte, at::kBool}) {
      auto t = (at::rand({3, 4}) * 10).to(dtype);
      auto back = rpc_sync<&echo_tensor>(1, t);
      EXPECT(back.scalar_type() == dtype);
      EXPECT(at::equal(back, t));
    }
    // 0-dim, empty, large
    auto scalar = at::scalar_tensor(3.5);
    EXPECT(at::equal(rpc_sync<&echo_tensor>(1, scalar), scalar));
    EXPECT_EQ(rpc_sync<&echo_tensor>(1, scalar).dim(), 0);
    auto empty = at::empty({0, 5});
    EXPECT(rpc_sync<&echo_tensor>(1, empty).sizes() == empty.sizes());
    auto big = at::rand({1 << 22});
    EXPECT(at::equal(rpc_sync<&echo_tensor>(1, big), big));
    // A transposed tensor is dense: it travels as it is and keeps its strides.
    auto base = at::arange(12, at::kFloat).reshape({3, 4});
    auto tr = base.t();
    auto [rg, sizes, strides] = rpc_sync<&describe>(1, tr);
    EXPECT(strides == tr.strides().vec());
    EXPECT(at::equal(rpc_sync<&echo_tensor>(1, tr), tr));
    // A view with gaps, and a slice with a storage offset: only the elements travel.
    auto gaps = base.index({at::indexing::Slice(), at::indexing::Slice(at::indexing::None, at::indexing::None, 2)});
    EXPECT(at::equal(rpc_sync<&echo_tensor>(1, gaps), gaps));
    auto row = base[2];
    EXPECT(at::equal(rpc_sync<&echo_tensor>(1, row), row));
    // requires_grad survives the trip.
    auto leaf = at::rand({2}).set_requires_grad(true);
    EXPECT(std::get<0>(rpc_sync<&describe>(1, leaf)));
    EXPECT(!std::get<0>(rpc_sync<&describe>(1, at::rand({2}))));
    // Containers of tensors, and the undefined tensor.
    auto many = rpc_sync<&echo_tensors>(1, std::vector<at::Tensor>{base, at::Tensor(), big});
    EXPECT_EQ(many.size(), 3u);
    EXPECT(at::equal(many[0], base));
    EXPECT(!many[1].defined());
    EXPECT(at::equal(many[2], big));
    // The callee gets its own copy: mutating it does not touch ours (also for calls to ourselves).
    auto mine = at::zeros({2});
    auto theirs = rpc_sync<&echo_tensor>(0, mine);
    theirs.add_(1);
    EXPECT(at::equal(mine, at::zeros({2})));
  });
}

TEST_CASE("nested coroutine calls A -> B -> C -> A complete, and awaiting holds no thread") {
  auto options = quick_options();
  options.num_worker_threads = 1;  // one thread per worker: a held thread would deadlock the call-back
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        auto path = rpc_sync<&relay>("worker1", std::vector<std::string>{"worker2", "master"});
        EXPECT_EQ(path, "worker1>worker2>master");
        EXPECT_EQ(sync_wait(ask_worker1_to_call_back()), 3);
      },
      options);
}

TEST_CASE("messages of every size around the read buffer's growth arrive intact, first ones included") {
  // A connection's read buffer starts at 4 KiB and grows to 64 KiB once a read fills it or a frame's head does not fit.
  // Each rank's first message on its connection is of a different kind (the largest, one just past the first buffer, a
  // tiny one), so that growth is met at the first frame and later; then every size in turn, on each side of it.
  const std::vector<std::size_t> sizes{1, 4000, 4096, 4097, 10000, 65000, 65536, 70000, std::size_t{1} << 20};
  run_world(3, [&](int rank) {
    const int peer = (rank + 1) % 3;
    auto text = [](std::size_t n, int seed) {
      std::string s(n, ' ');
      for (std::size_t i = 0; i < n; ++i) s[i] = static_cast<char>('a' + (i * 7 + seed) % 26);
      return s;
    };
    const std::size_t first = rank == 0 ? sizes.back() : rank == 1 ? 4097 : 1;
    EXPECT(rpc_sync<&echo<std::string>>(peer, text(first, rank)) == text(first, rank));
    for (std::size_t n : sizes) EXPECT(rpc_sync<&echo<std::string>>(peer, text(n, rank)) == text(n, rank));
    std::vector<Future<std::string>> burst;  // many small frames per read
    for (int i = 0; i < 500; ++i) burst.push_back(rpc_async<&echo<std::string>>(peer, text(10 + i % 200, i)));
    for (int i = 0; i < 500; ++i) EXPECT(burst[i].wait(60s) == text(10 + i % 200, i));
  });
}

TEST_CASE("thousands of calls in flight at once all complete with the right values") {
  run_world(3, [](int rank) {
    std::vector<Future<int>> fs;
    for (int i = 0; i < 3000; ++i) fs.push_back(rpc_async<&add>((rank + 1 + i % 2) % 3, i, rank));
    auto values = when_all(std::move(fs)).wait(60s);
    for (int i = 0; i < 3000; ++i) EXPECT_EQ(values[i], i + rank);
  });
}

TEST_CASE("a remote exception comes back typed, naming worker, function and cause") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    try {
      rpc_sync<&fail_with>(1, std::string("bad input"));
      EXPECT(false);
    } catch (const RemoteError& e) {
      EXPECT_EQ(e.worker(), "worker1");
      EXPECT(e.function().find("fail_with") != std::string::npos);
      EXPECT_EQ(e.type(), "std::invalid_argument");
      EXPECT_EQ(e.message(), "bad input");
    }
    EXPECT_EQ(rpc_sync<&add>(1, 1, 1), 2);  // the worker carries on
  });
}

TEST_CASE("a call that outlives its timeout fails with TimeoutError, and nothing else is disturbed") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto slow = rpc_async<&sleep_ms>(1, with_timeout(100ms), 1500);
    auto fast = rpc_async<&add>(1, 1, 2);
    EXPECT_THROWS_AS(slow.wait(10s), TimeoutError);
    EXPECT_EQ(fast.wait(10s), 3);
    EXPECT_EQ(rpc_sync<&sleep_ms>(1, with_timeout(5s), 10), 10);
  });
  auto options = quick_options();
  options.rpc_timeout = 150ms;  // the global default applies when the call names none
  run_world(
      2,
      [](int rank) {
        if (rank == 0) EXPECT_THROWS_AS(rpc_sync<&sleep_ms>(1, 1000), TimeoutError);
      },
      options);
}

TEST_CASE("unknown functions, wrong argument types and unknown workers are clear errors") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto msg = EXPECT_THROWS_AS(rpc_async<int>(1, "no_such_function", 1).wait(10s), UnknownFunctionError);
    EXPECT(msg.find("no_such_function") != std::string::npos);
    register_function<&add>("add_by_name");
    EXPECT_EQ(rpc_async<int>(0, "add_by_name", 2, 3).wait(10s), 5);
    auto types = EXPECT_THROWS_AS(rpc_async<int>(0, "add_by_name", std::string("two"), 3).wait(10s), ArgumentTypeError);
    EXPECT(types.find("std::tuple<int, int>") != std::string::npos);
    auto who = EXPECT_THROWS_AS(rpc_async<&add>("nobody", 1, 2).wait(10s), UnknownWorkerError);
    EXPECT(who.find("nobody") != std::string::npos);
    EXPECT_THROWS_AS(rpc_async<&add>(7, 1, 2).wait(10s), UnknownWorkerError);
    EXPECT_THROWS_AS(rpc_sync<&add>("nobody", 1, 2), UnknownWorkerError);
  });
}

TEST_CASE("a peer killed mid-call fails the waiting future with ConnectionError; the others carry on") {
  expect_only_rank_lost(2, "signal", [&] {  // and only it: graceful shutdown did not hang on it
    run_world(3, [](int rank) {
      if (rank != 0) return;
      auto doomed = rpc_async<&die_now>(2);
      auto slow = rpc_async<&sleep_ms>(2, 5000);  // in flight on the same peer
      EXPECT_THROWS_AS(doomed.wait(20s), ConnectionError);
      EXPECT_THROWS_AS(slow.wait(20s), ConnectionError);
      EXPECT_THROWS_AS(rpc_sync<&add>(2, 1, 1), ConnectionError);  // later calls fail fast
      EXPECT_EQ(rpc_sync<&add>(1, 1, 1), 2);
    });
  });
}

TEST_CASE("graceful shutdown waits for calls still in flight; non-graceful fails them") {
  run_world(3, [](int rank) {
    if (rank != 1) return;
    // Fire and forget: shutdown() (called by run_world right after) must let these finish everywhere.
    for (int i = 0; i < 20; ++i) (void)rpc_async<&sleep_ms>(2, 50);
  });
  launch_processes(
      2,
      [](int rank) {
        init_rpc(worker_name(rank), rank, 2, quick_options());
        if (rank == 0) {
          auto f = rpc_async<&sleep_ms>(1, 3000);
          std::this_thread::sleep_for(100ms);
          shutdown(false);
          EXPECT_THROWS_AS(f.wait(5s), ShutdownError);
          EXPECT_THROWS_AS(rpc_sync<&add>(1, 1, 1), ShutdownError);
        } else {
          shutdown(true);  // rank 0 leaves abruptly: this must not hang
        }
      },
      launch_options(60s, 10s));
}

TEST_CASE("ranks may start in any order; bad registrations are refused clearly") {
  LaunchOptions so = launch_options(60s, 5s);
  launch_processes(
      3,
      [](int rank) {
        if (rank == 0) std::this_thread::sleep_for(1500ms);    // the master comes last
        init_rpc(worker_name(rank), -1, -1, quick_options());  // rank and world size from the environment
        EXPECT_EQ(get_worker_info().rank, rank);
        EXPECT_EQ(rpc_sync<&whoami>((rank + 1) % 3), worker_name((rank + 1) % 3));
        shutdown(true);
      },
      so);
  // Two ranks with one name: every rank fails at once with the reason, none waits for its init timeout or the
  // launcher's grace (they used to, and were then reported as killed).
  try {
    launch_processes(
        3,
        [](int rank) {
          if (rank == 2) std::this_thread::sleep_for(300ms);  // registers second
          init_rpc(rank == 0 ? "master" : "same_name", rank, 3, quick_options());
          shutdown();
        },
        launch_options(120s, 60s));
    FAIL("duplicate names must fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    CHECK(e.failures().size() == 3);
    for (auto& f : e.failures()) CHECK(f.reason.find("'same_name' is already taken") != std::string::npos);
  }
  CHECK_THROWS_AS(init_rpc("bad name!", 0, 1), UsageError);
}

TEST_CASE("requests and replies that fill a connection's read buffer to its last bytes, each frame with its tag") {
  // A frame's header, metadata and body are read into a 64 KiB buffer when they fit; a sealed frame's 16-byte tag
  // follows them. Every size across that edge, both ways (the echo's reply is the same size), must arrive whole.
  run_world(2, [](int rank) {
    if (rank != 0) return;
    for (std::size_t n = 65536 - 160; n <= 65536 + 16; ++n) {
      const std::string s(n, static_cast<char>('a' + n % 26));
      EXPECT_EQ(rpc_sync<&echo<std::string>>(1, s), s);
    }
  });
}

TEST_CASE("malformed frames close only the offending connection") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto target = get_worker_info(1);
    asio::io_context io;
    // A peer that knows this run's secret and then sends garbage: the frame layer must cope.
    auto send_raw = [&](const std::string& bytes) {
      auto s = authenticated_socket(io, target);
      asio::write(s, asio::buffer(sealed(s, bytes)));
      EXPECT(hung_up(s));  // the worker hangs up on us instead of allocating or crashing
    };
    send_raw("GET / HTTP/1.1\r\n\r\nxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx");
    corpc::detail::FrameHeader h;
    h.kind = corpc::detail::FrameKind::Request;
    h.body_len = 0xfffffff0u;  // over the limit
    send_raw(std::string(reinterpret_cast<const char*>(&h), sizeof h));
    h.body_len = 4;
    h.num_tensors = 1;
    h.meta_len = 3;  // truncated tensor metadata
    h.tensor_bytes = 1ull << 40;
    send_raw(std::string(reinterpret_cast<const char*>(&h), sizeof h) + "abcdefg");
    h = corpc::detail::FrameHeader{};
    h.kind = corpc::detail::FrameKind::Request;  // a request before any hello
    send_raw(std::string(reinterpret_cast<const char*>(&h), sizeof h));
    EXPECT_EQ(rpc_sync<&add>(1, 2, 2), 4);  // worker1 is fine
  });
}

TEST_CASE("functions on the I/O threads, with several I/O threads sharing the connections") {
  auto options = quick_options();
  options.num_io_threads = 2;
  run_world(
      3,
      [](int rank) {
        // Every rank calls every other at once, so that connections in both directions land on both I/O threads.
        std::vector<Future<int>> sums;
        for (int i = 0; i < 300; ++i) sums.push_back(rpc_async<&add_on_io>((rank + 1 + i % 2) % 3, i, rank));
        for (int i = 0; i < 300; ++i) EXPECT_EQ(sums[i].wait(30s), i + rank);
        const std::vector<std::string> path{worker_name((rank + 2) % 3), worker_name(rank)};
        EXPECT_EQ(rpc_async<&relay_on_io>((rank + 1) % 3, path).wait(30s),
                  worker_name((rank + 1) % 3) + ">" + worker_name((rank + 2) % 3) + ">" + worker_name(rank));
        EXPECT_EQ(rpc_sync<&add>((rank + 1) % 3, 2, 3), 5);  // pool functions alongside
        // The threads carry names that say what they are.
        EXPECT_EQ(rpc_sync<&thread_name>((rank + 1) % 3), "corpc-worker");
        for (int peer : {(rank + 1) % 3, (rank + 2) % 3}) {
          const std::string io_name = rpc_sync<&io_thread_name>(peer);
          EXPECT(io_name == "corpc-io-0" || io_name == "corpc-io-1");
        }
      },
      options);
}

TEST_CASE("connections must prove the run's secret before anything is read; strangers change nothing") {
  auto options = quick_options();
  // Short, so that the silent strangers below are dropped soon; stretched like every bound for sanitized runs (at a
  // bare 300 ms a legitimate rank's own handshake timed out once under TSan on a loaded machine).
  options.handshake_timeout = 300ms * time_scale();
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        asio::io_context io;
        const auto target = get_worker_info(1);
        const std::string local_socket = rpc_socket_of(rpc_sync<&process_id>(1));
        EXPECT(!local_socket.empty());
        // Both ways in: the TCP port, and the Unix socket that peers on its host use.
        for (const bool over_unix : {false, true}) {
          auto dial = [&] { return over_unix ? raw_local_socket(io, local_socket) : raw_socket(io, target); };
          // Speaking the frame protocol without the handshake: dropped.
          {
            auto s = dial();
            asio::write(s, asio::buffer(std::string("GET / HTTP/1.1\r\n\r\n") + std::string(64, 'x')));
            EXPECT(hung_up(s));
          }
          // The wrong secret: refused by the worker, and the worker's proof would not have convinced us either.
          EXPECT_THROWS_AS(authenticated_socket(io, dial(), "not the secret"), ConnectionError);
          // Silent strangers (a port scanner, a half-open connection): dropped after the handshake timeout.
          {
            std::vector<asio::ip::tcp::socket> silent;
            for (int i = 0; i < 20; ++i) silent.push_back(dial());
            for (auto& s : silent) EXPECT(hung_up(s));
          }
          // An impostor claiming to be rank 2 (a Hello with its name and rank), then hanging up: before
          // authentication this marked rank 2 dead on worker1. Now it never gets to say Hello.
          {
            auto s = dial();
            (void)write_raw_hello(s, get_worker_info(2), 3);
            s.close();
          }
        }
        std::this_thread::sleep_for(200ms);
        EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // worker1 still reaches worker2
        EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
      },
      options);
}

TEST_CASE("a dialer tells nothing to an acceptor that cannot prove the secret: no Hello, only a refusal") {
  // A stranger listening where rank 0 should be (a port taken over after a crash, say): it answers the challenge with
  // a proof it cannot have made. The dialing rank must refuse it before saying who it is.
  launch_processes(
      1,
      [](int) {
        asio::io_context io;
        asio::ip::tcp::acceptor stranger(io, {asio::ip::make_address("127.0.0.1"), 0});
        const std::uint16_t port = stranger.local_endpoint().port();
        std::string heard;  // everything the dialer sent after our answer
        std::thread fake([&] {
          asio::ip::tcp::socket s(io);
          stranger.accept(s);
          std::array<char, 20> challenge;
          asio::read(s, asio::buffer(challenge));
          std::array<char, 52> answer{};
          std::memcpy(answer.data(), challenge.data(), 4);  // the tag, a nonce and a proof of nothing
          asio::write(s, asio::buffer(answer));
          asio::error_code ec;
          char buf[256];
          for (std::size_t n; (n = s.read_some(asio::buffer(buf), ec)) > 0 || !ec;) heard.append(buf, n);
        });
        auto options = quick_options();
        options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        options.init_timeout = 5s * time_scale();
        const std::string why = EXPECT_THROWS_AS(init_rpc(worker_name(1), 1, 2, options), ConnectionError);
        EXPECT_CONTAINS(why, "does not know our secret");
        fake.join();
        EXPECT_EQ(heard, std::string(32, '\0'));  // a proof that cannot match, and nothing else
      },
      launch_options(60s));
}

// A port on `host` that nothing listens on, or 0 if this machine cannot listen there (no IPv6, say).
std::uint16_t free_port_on(const std::string& host) {
  try {
    asio::io_context io;
    asio::ip::tcp::acceptor probe(io, {asio::ip::make_address(host), 0});
    return probe.local_endpoint().port();
  } catch (const std::exception&) {
    return 0;
  }
}

// A job whose rank 0 listens on `host`, a loopback address other than 127.0.0.1: every worker stays on loopback.
void loopback_job(const std::string& host) {
  const std::uint16_t port = free_port_on(host);
  REQUIRE(port != 0);
  launch_processes(
      2,
      [&](int rank) {
        auto options = quick_options();
        options.init_method =
            "tcp://" + (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
        init_rpc(worker_name(rank), rank, 2, options);
        EXPECT(asio::ip::make_address(get_worker_info(0).host).is_loopback());
        EXPECT(asio::ip::make_address(get_worker_info(1).host).is_loopback());
        EXPECT_EQ(rpc_sync<&whoami>((rank + 1) % 2), worker_name((rank + 1) % 2));
        shutdown(true);
      },
      launch_options(60s));
}

TEST_CASE("workers on one host connect over a Unix socket; one that turns it off is dialed over TCP") {
  // Rank 0 dials ranks 1 and 2 after init_rpc: each dial is a new connection, counted by where it goes (the peers' TCP
  // ports, or a Unix socket). Connections others open to rank 0 do not count: whether a peer's shutdown has dialed us
  // yet when we look is a race, and it is not what this test is about.
  for (const bool rank2_on : {true, false}) {
    CAPTURE(rank2_on);
    launch_processes(
        3,
        [&](int rank) {
          auto options = quick_options();
          if (rank == 2) options.same_host_socket = rank2_on;
          init_rpc(worker_name(rank), rank, 3, options);
          if (rank == 0) {
            const std::vector<std::uint16_t> peers{get_worker_info(1).port, get_worker_info(2).port};
            const auto before = own_sockets(peers);
            expect_count(static_cast<int>(before.dialed.size()), 0,
                         "TCP connections to peers before any call:" + before.tcp);
            EXPECT_EQ(rpc_sync<&add>(1, 1, 2), 3);
            EXPECT_EQ(rpc_sync<&add>(2, 3, 4), 7);
            EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // 1 -> 2 too
            EXPECT_EQ(rpc_sync<&whoami_via>(2, 1), worker_name(1));  // and 2 -> 1
            const auto after = own_sockets(peers);
            const std::string seen = "; TCP connections before:" + before.tcp + ", after:" + after.tcp;
            expect_count(after.unix_connected - before.unix_connected, rank2_on ? 2 : 1, "new Unix connections" + seen);
            expect_count(static_cast<int>(after.dialed.size()), rank2_on ? 0 : 1, "TCP connections to peers" + seen);
          }
          shutdown(true);
        },
        launch_options(60s));
  }
  // Off everywhere (CORPC_SAME_HOST_SOCKET=0 sets the same option): all over TCP.
  auto off = quick_options();
  off.same_host_socket = false;
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        const std::vector<std::uint16_t> peer{get_worker_info(1).port};
        const auto before = own_sockets(peer);
        EXPECT_EQ(rpc_sync<&add>(1, 1, 2), 3);
        const auto after = own_sockets(peer);
        EXPECT_EQ(after.unix_connected, before.unix_connected);
        EXPECT_EQ(static_cast<int>(before.dialed.size()), 0);
        EXPECT_EQ(static_cast<int>(after.dialed.size()), 1);
      },
      off);
}

TEST_CASE("a peer whose Unix socket takes no more connections is dialed over TCP" *
          doctest::skip(!can_fill_a_backlog())) {
  // A Unix connect does not wait: when the listener's backlog is full it fails at once, and the dialer must fall back
  // to the peer's TCP port. Rank 0 stops rank 1 and fills its Unix socket's backlog; rank 2's first call to rank 1
  // must then open a TCP connection, and complete once rank 1 runs again.
  launch_processes(
      3,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, 3, quick_options());
        if (rank == 0) {
          const int target = rpc_sync<&process_id>(1);
          const std::string name = rpc_socket_of(target);
          EXPECT(!name.empty());
          expect_dialed(rpc_sync<&own_tcp_to>(2, -1), 1, "rank 2's TCP connections to peers");  // its registration
          expect_dialed(own_tcp_to(1), 0, "rank 0's TCP connections to rank 1");  // it took the Unix socket
          stop_process(target);
          const std::vector<int> queued = fill_backlog(name);
          auto reply = rpc_async<&whoami_via>(2, 1);
          // The kernel completes a TCP handshake for a stopped listener: rank 2's dial shows as established.
          const auto give_up = std::chrono::steady_clock::now() + 30s * time_scale();
          std::vector<std::string> to_rank1;
          while ((to_rank1 = rpc_sync<&own_tcp_to>(2, 1)).empty() && std::chrono::steady_clock::now() < give_up)
            std::this_thread::sleep_for(5ms);
          for (const int fd : queued) ::close(fd);  // rank 1 reads these as strangers that hung up
          ::kill(target, SIGCONT);
          EXPECT(queued.size() > 0);
          expect_dialed(to_rank1, 1, "rank 2's TCP connections to rank 1 while its Unix socket was full");
          EXPECT_EQ(reply.wait(), worker_name(1));
          expect_dialed(rpc_sync<&own_tcp_to>(2, -1), 2, "rank 2's TCP connections to peers after the fallback");
          EXPECT_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // and rank 1 still serves and dials
        }
        shutdown(true);
      },
      launch_options(60s));
}

TEST_CASE("a job whose rank 0 is on 127.0.0.2 stays on loopback and works (skipped where it cannot listen there)" *
          doctest::skip(free_port_on("127.0.0.2") == 0)) {
  loopback_job("127.0.0.2");
}

TEST_CASE("a job whose rank 0 is on ::1 stays on loopback and works (skipped without IPv6 loopback)" *
          doctest::skip(free_port_on("::1") == 0)) {
  loopback_job("::1");
}

TEST_CASE("a rank 0 whose port another process holds fails at once, saying where the port came from") {
  // What a torchrun job meets when another socket took the port its agent chose and released.
  asio::io_context io;
  asio::ip::tcp::acceptor holder(io, {asio::ip::make_address("127.0.0.1"), 0});  // listening: the port is taken
  const auto port = holder.local_endpoint().port();
  launch_processes(
      1,
      [port](int) {
        auto options = quick_options();
        options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        auto why = EXPECT_THROWS_AS(init_rpc("solo", 0, 1, options), ConnectionError);
        EXPECT(why.find("cannot listen on 127.0.0.1:" + std::to_string(port)) != std::string::npos);
        EXPECT(why.find("from init_method") != std::string::npos);
        EXPECT(why.find("another process holds that port") != std::string::npos);
      },
      launch_options(60s));
}

TEST_CASE("workers whose master died fail their shutdown instead of exiting as a success") {
  expect_only_rank_lost(0, "", [&] {  // the master; the workers saw the typed error and stopped
    launch_processes(
        3,
        [](int rank) {
          init_rpc(worker_name(rank), rank, 3, quick_options());
          EXPECT_EQ(rpc_sync<&add>((rank + 1) % 3, 1, 1), 2);  // everyone is connected
          if (rank == 0) {
            std::this_thread::sleep_for(200ms);
            ::raise(SIGKILL);
          }
          auto why = EXPECT_THROWS_AS(shutdown(true), ConnectionError);
          EXPECT(why.find("rank 0 died") != std::string::npos);
        },
        launch_options(60s));
  });
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif

// Memory no pointer reaches once this returns: out of line, so that no register or stack slot of the rank keeps it.
[[gnu::noinline]] void leak_some_memory() {
  for (int i = 0; i < 64; ++i) {
    auto* p = new int[16];
    std::memset(p, i, 16 * sizeof(int));
    asm volatile("" : : "r"(p) : "memory");
  }
}

TEST_CASE("under AddressSanitizer a rank that leaks fails with LeakSanitizer's report (skipped in other builds)" *
          doctest::skip(!kAddressSanitizer)) {
  // This suite runs with CORPC_RANK_LEAK_CHECK=1 (tests/meson.build): every rank's leaks are checked as it exits.
  try {
    launch_processes(
        2,
        [](int rank) {
          if (rank == 1) leak_some_memory();
        },
        launch_options(60s));
    FAIL("the leaking rank was expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 1);
    CHECK(e.failures()[0].reason.find("LeakSanitizer found leaks") != std::string::npos);
  }
}

}  // namespace test_rpc
