// rpc_bench — corpc round-trip latency and throughput, each case measured against a raw Asio TCP floor.
//
// Two ranks via corpc::launch_processes: rank 0 is the client, rank 1 the server. Cases:
//   noop      rpc_sync of `void noop()`
//   4KiB ..   rpc_sync of `at::Tensor echo(const at::Tensor&)` with a float32 tensor of that size (it travels both ways)
//   async64   rpc_async of noop with 64 calls in flight (calls/s; latency = issue -> consumed by the client); async1
//             and async1024 (on request) keep 1 and 1024 in flight
//
// The raw floor runs between the same two processes, in the same run: rank 1 hosts an Asio echo server (one thread
// running an io_context with a C++20-coroutine echo loop, like corpc's network thread), rank 0 talks to it with
// blocking asio::write / asio::read on its calling thread, TCP_NODELAY on both ends, over 127.0.0.1. A raw message is
// an 8-byte length followed by the payload; the server reads the whole message, then writes it back. The raw client
// reuses one receive buffer; corpc receives each reply into a fresh tensor, whose memory comes from its receive pool
// from 1 MiB on (--host-cache-mib 0: from the default allocator, fresh pages each time). raw asyncN keeps N header-only messages in flight on the one connection.
//
// A VM's vCPUs move between fast and slow placements, so each case alternates short blocks
// of raw and corpc (ABBA order) and reports the ratio per block pair; the headline ratio is the median of those.
// Ratio = corpc time per call / raw time per call (for async64: raw calls/s / corpc calls/s); > 1: corpc is slower.
// The async cases also report the CPU time both processes spent per call, over all their threads (each process's
// CPU clock), and the kernel's share of it: what bounds calls/s on a machine whose cores are all busy.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <asio.hpp>
#include <fmt/core.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "corpc/corpc.hpp"
#include "corpc/rref/rref.hpp"

#include "../src/transport/shm_channel.hpp"
#include "../tools/tls_certs.hpp"
#include "bench_util.hpp"

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// ---- the remote functions ---------------------------------------------------------------------------------------
void noop() {}
at::Tensor echo(const at::Tensor& t) { return t; }
std::int64_t small_value() { return 42; }
void pause_same_host(bool paused) { corpc::detail::set_shm_sends_paused(paused); }
// The middle of the chain case: B awaits C, holding no thread, and answers A.
corpc::Task<void> relay_noop() { co_await corpc::rpc_async<&noop>(2); }
}  // namespace
// All short and never blocking: they run on the I/O thread that reads the request (no hand-off to the pool).
// The cancel case: rank 1 parks a coroutine function until its call is cancelled, and notes when it saw the stop.
std::atomic<bool> g_parked{false};
std::atomic<std::int64_t> g_stop_seen_ns{0};
using corpc::bench::now_ns;
corpc::Task<void> park_until_cancelled() {
  static corpc::Promise<void> never;
  g_parked = true;
  try {
    co_await never.get_future();
  } catch (const corpc::CancelledError&) {
    g_stop_seen_ns = now_ns();
    throw;
  }
}
bool parked() { return g_parked.exchange(false); }
std::int64_t stop_seen_ns() { return g_stop_seen_ns.exchange(0); }
CORPC_IO_THREAD_FUNCTION(&parked);
CORPC_IO_THREAD_FUNCTION(&stop_seen_ns);
CORPC_IO_THREAD_FUNCTION(&noop);
CORPC_IO_THREAD_FUNCTION(&echo);
CORPC_IO_THREAD_FUNCTION(&small_value);
CORPC_IO_THREAD_FUNCTION(&relay_noop);
namespace {
std::atomic<int> g_raw_port{0};
int raw_port() { return g_raw_port.load(); }
std::atomic<int> g_relay_port{0};
int relay_port() { return g_relay_port.load(); }
int server_pid() { return static_cast<int>(::getpid()); }

// ---- CPU time of a process, all its threads -----------------------------------------------------------------------
// Nanoseconds on a CPU (the process's CPU clock, clock_getcpuclockid) and the user and system clock ticks
// (/proc/PID/stat): what the async cases cost in CPU per call, and how much of it is the kernel's. Both count every
// thread of the process, exited ones included.
struct CpuTime {
  std::int64_t ns = 0;
  std::int64_t user_ticks = 0, system_ticks = 0;
  CpuTime operator-(const CpuTime& o) const {
    return {ns - o.ns, user_ticks - o.user_ticks, system_ticks - o.system_ticks};
  }
  CpuTime operator+(const CpuTime& o) const {
    return {ns + o.ns, user_ticks + o.user_ticks, system_ticks + o.system_ticks};
  }
};

CpuTime process_cpu(int pid) {
  CpuTime t;
  clockid_t clock;
  timespec ts{};
  if (::clock_getcpuclockid(pid, &clock) == 0 && ::clock_gettime(clock, &ts) == 0)
    t.ns = ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string line;
  std::getline(stat, line);
  // The fields after the command (which may hold spaces) start after its closing parenthesis; utime and stime are
  // the 14th and 15th fields of the line, the 12th and 13th after the state.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return t;
  std::istringstream rest(line.substr(close + 2));
  std::string field;
  for (int i = 0; i < 11 && rest >> field; ++i) {}
  rest >> t.user_ticks >> t.system_ticks;
  return t;
}

// ---- options ----------------------------------------------------------------------------------------------------
enum class Kind { echo, async, remote, chain };
struct CaseSpec {
  std::string name;
  std::size_t bytes;  // payload each way; 0 for noop / asyncN / remote / chain
  Kind kind = Kind::echo;
  int in_flight = 1;  // asyncN: calls kept in flight
  bool async() const { return kind == Kind::async; }
};

// remote: `remote<&f>(1)` then `to_here()`, against two raw ping-pongs. chain: A calls B, whose coroutine calls C
// and answers A (3 ranks), against a raw relay (A -> B -> C -> B -> A, B forwarding on one io_context thread).
const std::vector<CaseSpec> kAllCases = {
    {"noop", 0},
    {"4KiB", 4u << 10},
    {"1MiB", 1u << 20},
    {"16MiB", 16u << 20},
    {"64MiB", 64u << 20},
    {"async64", 0, Kind::async, 64},
    {"remote", 0, Kind::remote},
    {"chain", 0, Kind::chain},
};
// Accepted by --cases, not run by default: the sizes around the same-host channel's threshold (64 KiB), and other
// numbers of calls in flight.
const std::vector<CaseSpec> kExtraCases = {
    {"64KiB", 64u << 10}, {"256KiB", 256u << 10}, {"async1", 0, Kind::async, 1}, {"async1024", 0, Kind::async, 1024}};
bool wants_chain(const std::vector<CaseSpec>& cases) {
  return std::any_of(cases.begin(), cases.end(), [](const CaseSpec& c) { return c.kind == Kind::chain; });
}
struct Options {
  double seconds_per_case = 2.0;
  double block_ms = 100.0;
  int min_iters = 3;  // per block, for the slow cases
  int worker_threads = 0;
  int spin_us = -1;          // corpc's spin before a blocked wait sleeps; -1: RpcOptions' default
  long host_cache_mib = -1;  // HostMemoryOptions::cache_bytes in MiB; -1: its default, 0: no block cache
  bool raw_alloc = false;    // raw receivers allocate a fresh at::empty buffer per message, as corpc must
  std::vector<CaseSpec> cases = kAllCases;
  std::string json_path;
  int cancel_samples = 200;  // cancel -> callee-sees-it samples after the cases; 0: skip
  bool flow_control = true;  // false: flow control's limits so high that they never bind (bench/flow_cost.sh)
  bool same_host = true;     // --channel shm (RpcOptions::same_host_channel) or tcp
  bool unix_socket = true;   // --socket unix (RpcOptions::same_host_socket) or tcp
  bool transfers = false;    // --transfers: the echo cases on the same-host channel, TCP, the raw floor and memcpy
  std::optional<corpc::TlsOptions> tls;  // corpc's connections over TLS (bench/tls_cost.sh); the raw floor stays TCP
};

[[noreturn]] void usage(int code) {
  std::fprintf(
      code ? stderr : stdout,
      "usage: rpc_bench [--seconds-per-case S] [--cases noop,4KiB,1MiB,16MiB,64MiB,async64,remote,chain]\n"
      "                 (also 64KiB,256KiB,async1,async1024)\n"
      "                 [--block-ms MS] [--min-iters N] [--worker-threads N] [--spin-us US] [--raw-alloc]\n"
      "                 [--json PATH] [--cancel-samples N] [--host-cache-mib N] [--flow-control on|off]\n"
      "                 [--channel shm|tcp] [--socket unix|tcp] [--transfers] [--tls generate|CERT,KEY,CA]\n"
      "Each case alternates blocks of raw Asio TCP and corpc (~MS ms each, >= N calls) for ~S seconds\n"
      "and reports the median of the per-block ratios corpc/raw.\n"
      "--raw-alloc: the raw floor receives each message into a freshly allocated at::empty buffer (both\n"
      "ends), as corpc does, instead of reusing one buffer: separates allocation cost from corpc's own.\n"
      "--spin-us: how long corpc's blocked waits spin before sleeping (RpcOptions::spin_before_block; the raw\n"
      "floor always sleeps in read()); 0 compares both sleeping.\n"
      "--cancel-samples: after the cases, times N cancellations of a parked coroutine function on rank 1,\n"
      "from Future::cancel() on rank 0 to the callee's await throwing CancelledError (one steady clock).\n"
      "--flow-control off: per-peer call limit, receive budgets, held requests and write backlog so high that\n"
      "they never bind (the checks still run): bench/flow_cost.sh compares on and off.\n"
      "--channel: corpc between the two processes on its same-host channel (shm, the default) or on its socket only.\n"
      "--socket: corpc's connections between the two processes on an abstract Unix socket (unix, the default:\n"
      "RpcOptions::same_host_socket) or on TCP.\n"
      "--transfers: instead of the table above, each echo case (1MiB... by default) in rotating blocks of\n"
      "corpc on the same-host channel, corpc on TCP (channel paused in both processes), the raw TCP floor,\n"
      "and a single-threaded memcpy there and back, all in one run.\n"
      "--tls: corpc's connections use TLS 1.3 (RpcOptions::tls) with these PEM files, or with a throwaway CA\n"
      "and certificate made for the run (generate); the raw floor stays plain TCP. bench/tls_cost.sh compares\n"
      "TLS with plain TCP.\n");
  std::exit(code);
}

Options parse(int argc, char** argv) {
  const corpc::bench::Flags flags(
      argc, argv,
      {"seconds-per-case", "block-ms", "min-iters", "worker-threads", "spin-us", "host-cache-mib", "json",
       "cancel-samples", "flow-control", "channel", "socket", "tls", "cases"},
      {"help", "h", "raw-alloc", "transfers"});
  if (flags.has("help") || flags.has("h")) usage(0);
  Options o;
  try {
    flags.check();
    o.seconds_per_case = flags.get_double("seconds-per-case", o.seconds_per_case);
    o.block_ms = flags.get_double("block-ms", o.block_ms);
    o.min_iters = std::max(1, flags.get_int<int>("min-iters", o.min_iters));
    o.worker_threads = flags.get_int<int>("worker-threads", o.worker_threads);
    o.spin_us = flags.get_int<int>("spin-us", o.spin_us);
    o.host_cache_mib = flags.get_int("host-cache-mib", o.host_cache_mib);
    o.raw_alloc = flags.has("raw-alloc");
    o.json_path = flags.get("json", o.json_path);
    o.cancel_samples = flags.get_int<int>("cancel-samples", o.cancel_samples);
    if (flags.has("flow-control")) {
      const std::string v = flags.get("flow-control", "");
      if (v != "on" && v != "off") usage(2);
      o.flow_control = v == "on";
    }
    if (flags.has("channel")) {
      const std::string v = flags.get("channel", "");
      if (v != "shm" && v != "tcp") usage(2);
      o.same_host = v == "shm";
    }
    o.transfers = flags.has("transfers");
    if (flags.has("socket")) {
      const std::string v = flags.get("socket", "");
      if (v != "unix" && v != "tcp") usage(2);
      o.unix_socket = v == "unix";
    }
    if (flags.has("tls")) {
      const std::string v = flags.get("tls", "");
      o.tls.emplace();
      if (v != "generate") {
        std::stringstream ss(v);
        std::getline(ss, o.tls->certificate_chain_file, ',');
        std::getline(ss, o.tls->private_key_file, ',');
        std::getline(ss, o.tls->ca_file, ',');
        if (o.tls->ca_file.empty()) usage(2);
      }
    }
    if (flags.has("cases")) {
      o.cases.clear();
      std::stringstream ss(flags.get("cases", ""));
      for (std::string c; std::getline(ss, c, ',');) {
        auto named = [&](const CaseSpec& s) { return s.name == c; };
        auto it = std::find_if(kAllCases.begin(), kAllCases.end(), named);
        if (it == kAllCases.end()) it = std::find_if(kExtraCases.begin(), kExtraCases.end(), named);
        if (it == kExtraCases.end()) {
          std::fprintf(stderr, "unknown case '%s'\n", c.c_str());
          usage(2);
        }
        o.cases.push_back(*it);
      }
    }
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    usage(2);
  }
  if (o.transfers) {
    if (!flags.has("cases")) o.cases = {kAllCases[2], kAllCases[3], kAllCases[4]};
    o.cases.erase(std::remove_if(o.cases.begin(), o.cases.end(), [](const CaseSpec& c) { return c.bytes == 0; }),
                  o.cases.end());
    o.same_host = true;
  }
  if (o.seconds_per_case <= 0 || o.block_ms <= 0 || o.cases.empty()) usage(2);
  return o;
}

// ---- statistics -------------------------------------------------------------------------------------------------
using corpc::bench::median;
double p99(std::vector<double> v) {  // as bench/pytorch_rpc_bench.py computes it
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(0.99 * static_cast<double>(v.size())))];
}
double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

// ---- raw Asio floor ---------------------------------------------------------------------------------------------
// Server (rank 1): one connection, one coroutine; returns when the client closes.
asio::awaitable<void> raw_echo_session(tcp::acceptor& acceptor, bool fresh_buffers) {
  tcp::socket s = co_await acceptor.async_accept(asio::use_awaitable);
  s.set_option(tcp::no_delay(true));
  acceptor.close();
  std::vector<char> buf;
  try {
    for (;;) {
      std::uint64_t n = 0;
      co_await asio::async_read(s, asio::buffer(&n, sizeof n), asio::use_awaitable);
      if (n > (1ull << 31)) throw std::runtime_error("raw echo: absurd length");
      at::Tensor fresh;
      char* data;
      if (fresh_buffers) {
        fresh = at::empty({static_cast<std::int64_t>(n)}, at::kByte);
        data = static_cast<char*>(fresh.data_ptr());
      } else {
        if (buf.size() < n) buf.resize(n);
        data = buf.data();
      }
      co_await asio::async_read(s, asio::buffer(data, n), asio::use_awaitable);
      std::array<asio::const_buffer, 2> out{asio::buffer(&n, sizeof n), asio::buffer(data, n)};
      co_await asio::async_write(s, out, asio::use_awaitable);
    }
  } catch (const std::system_error& e) {
    if (e.code() != asio::error::eof && e.code() != asio::error::connection_reset) throw;
  }
}

// Relay (rank 1, chain case): forwards each message from the client to rank 2's echo server and the answer back.
asio::awaitable<void> raw_relay_session(tcp::acceptor& acceptor, int upstream_port) {
  tcp::socket client = co_await acceptor.async_accept(asio::use_awaitable);
  client.set_option(tcp::no_delay(true));
  acceptor.close();
  tcp::socket up(client.get_executor());
  co_await up.async_connect(
      tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(upstream_port)),
      asio::use_awaitable);
  up.set_option(tcp::no_delay(true));
  std::vector<char> buf;
  try {
    for (;;) {
      for (tcp::socket* from : {&client, &up}) {
        tcp::socket* to = from == &client ? &up : &client;
        std::uint64_t n = 0;
        co_await asio::async_read(*from, asio::buffer(&n, sizeof n), asio::use_awaitable);
        if (n > (1ull << 31)) throw std::runtime_error("raw relay: absurd length");
        if (buf.size() < n) buf.resize(n);
        co_await asio::async_read(*from, asio::buffer(buf.data(), n), asio::use_awaitable);
        std::array<asio::const_buffer, 2> out{asio::buffer(&n, sizeof n), asio::buffer(buf.data(), n)};
        co_await asio::async_write(*to, out, asio::use_awaitable);
      }
    }
  } catch (const std::system_error& e) {
    if (e.code() != asio::error::eof && e.code() != asio::error::connection_reset) throw;
  }
  asio::error_code ec;
  up.shutdown(tcp::socket::shutdown_both, ec);  // ends rank 2's echo session
}

class RawClient {
 public:
  void connect(int port, std::size_t max_bytes, bool fresh_buffers) {
    fresh_ = fresh_buffers;
    socket_.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)));
    socket_.set_option(tcp::no_delay(true));
    out_.assign(max_bytes, 0);
    for (std::size_t i = 0; i < max_bytes; ++i) out_[i] = static_cast<char>(i * 131 + 7);
    in_.assign(max_bytes, 0);
  }
  void close() {
    asio::error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }
  void send(std::size_t n) {
    std::uint64_t h = n;
    std::array<asio::const_buffer, 2> bufs{asio::buffer(&h, sizeof h), asio::buffer(out_.data(), n)};
    asio::write(socket_, bufs);
  }
  void receive(std::size_t n) {
    std::uint64_t h = 0;
    asio::read(socket_, asio::buffer(&h, sizeof h));
    if (h != n) throw std::runtime_error(fmt::format("raw echo: sent {} bytes, got {}", n, h));
    char* data = in_.data();
    if (fresh_) {
      last_ = at::empty({static_cast<std::int64_t>(n)}, at::kByte);  // the previous one is freed here
      data = static_cast<char*>(last_.data_ptr());
    }
    asio::read(socket_, asio::buffer(data, n));
  }
  void round_trip(std::size_t n) {
    send(n);
    receive(n);
  }
  bool echoed_ok(std::size_t n) const {
    const char* got = fresh_ && n ? static_cast<const char*>(last_.data_ptr()) : in_.data();
    return std::memcmp(out_.data(), got, n) == 0;
  }

 private:
  asio::io_context ctx_;
  tcp::socket socket_{ctx_};
  std::vector<char> out_, in_;
  bool fresh_ = false;
  at::Tensor last_;
};

// ---- blocks -----------------------------------------------------------------------------------------------------
struct Block {
  std::vector<double> lat_us;
  double calls_per_s = 0;
  std::size_t calls = 0;
};

// Latency block: `once()` repeatedly for block_ms and at least min_iters calls.
template <class F>
Block latency_block(const Options& o, F&& once) {
  Block b;
  auto start = Clock::now();
  while (us_since(start) < o.block_ms * 1e3 || static_cast<int>(b.lat_us.size()) < o.min_iters) {
    auto t = Clock::now();
    once();
    b.lat_us.push_back(us_since(t));
  }
  b.calls_per_s = static_cast<double>(b.lat_us.size()) / (us_since(start) / 1e6);
  return b;
}

Block raw_async_block(const Options& o, RawClient& raw, std::size_t in_flight) {
  Block b;
  std::deque<Clock::time_point> issued;
  auto start = Clock::now();
  std::size_t done = 0;
  auto consume = [&] {
    raw.receive(0);
    b.lat_us.push_back(us_since(issued.front()));
    issued.pop_front();
    ++done;
  };
  while (us_since(start) < o.block_ms * 1e3) {
    if (issued.size() == in_flight) consume();
    issued.push_back(Clock::now());
    raw.send(0);
  }
  while (!issued.empty()) consume();
  b.calls_per_s = static_cast<double>(done) / (us_since(start) / 1e6);
  b.calls = done;
  return b;
}

Block corpc_async_block(const Options& o, std::size_t in_flight) {
  Block b;
  std::deque<std::pair<corpc::Future<void>, Clock::time_point>> window;
  auto start = Clock::now();
  std::size_t done = 0;
  auto consume = [&] {
    window.front().first.wait();
    b.lat_us.push_back(us_since(window.front().second));
    window.pop_front();
    ++done;
  };
  while (us_since(start) < o.block_ms * 1e3) {
    if (window.size() == in_flight) consume();
    auto t = Clock::now();
    window.emplace_back(corpc::rpc_async<&noop>(1), t);
  }
  while (!window.empty()) consume();
  b.calls_per_s = static_cast<double>(done) / (us_since(start) / 1e6);
  b.calls = done;
  return b;
}

// ---- one case ---------------------------------------------------------------------------------------------------
struct CaseResult {
  CaseSpec spec;
  std::vector<double> corpc_us, raw_us;      // all samples
  std::vector<double> corpc_rate, raw_rate;  // calls/s per block
  std::vector<double> ratios;                // per block pair
  // The async cases: both processes' CPU time over all blocks of each, and the calls they made.
  CpuTime corpc_cpu, raw_cpu;
  std::size_t corpc_calls = 0, raw_calls = 0;
};

CaseResult run_case(const Options& o, const CaseSpec& c, RawClient& raw, RawClient& relay, int server) {
  CaseResult r{c, {}, {}, {}, {}, {}, {}, {}, 0, 0};
  const int client = static_cast<int>(::getpid());
  auto both_cpu = [&] { return process_cpu(client) + process_cpu(server); };
  at::Tensor t;
  if (!c.async() && c.bytes) t = at::rand({static_cast<std::int64_t>(c.bytes / sizeof(float))});

  auto corpc_once = [&] {
    if (c.kind == Kind::remote) {
      auto ref = corpc::remote<&small_value>(1);
      if (ref.to_here().wait() != 42) throw std::runtime_error("remote: wrong value");
    } else if (c.kind == Kind::chain) {
      corpc::rpc_sync<&relay_noop>(1);
    } else if (c.bytes) {
      at::Tensor back = corpc::rpc_sync<&echo>(1, t);
      if (back.numel() != t.numel()) throw std::runtime_error("echo returned a tensor of the wrong size");
    } else {
      corpc::rpc_sync<&noop>(1);
    }
  };
  auto raw_once = [&] {
    if (c.kind == Kind::chain) return relay.round_trip(0);
    raw.round_trip(c.bytes);
    if (c.kind == Kind::remote) raw.round_trip(c.bytes);  // remote() and to_here() are a round trip each
  };

  // Warm-up, with a check of the results.
  for (int i = 0; i < 3; ++i) {
    raw_once();
    if (!raw.echoed_ok(c.bytes)) throw std::runtime_error("raw echo returned different bytes");
    if (c.kind == Kind::remote || c.kind == Kind::chain) {
      corpc_once();
    } else if (c.bytes) {
      at::Tensor back = corpc::rpc_sync<&echo>(1, t);
      if (!back.equal(t)) throw std::runtime_error(c.name + ": corpc echo returned a different tensor");
      if (back.data_ptr() == t.data_ptr()) throw std::runtime_error(c.name + ": echo did not cross the wire?");
    } else {
      corpc::rpc_sync<&noop>(1);
    }
  }
  if (c.async()) {
    Options w = o;
    w.block_ms = 20;
    corpc_async_block(w, static_cast<std::size_t>(c.in_flight));
    raw_async_block(w, raw, static_cast<std::size_t>(c.in_flight));
  }

  auto start = Clock::now();
  for (int pair = 0; pair < 3 || us_since(start) < o.seconds_per_case * 1e6; ++pair) {
    Block rb, cb;
    // The calling thread's name says whose block it runs, so that a profiler (perf report --sort comm) can keep the
    // two apart.
    auto do_raw = [&] {
      ::pthread_setname_np(::pthread_self(), "client-raw");
      if (!c.async()) return void(rb = latency_block(o, raw_once));
      const CpuTime before = both_cpu();
      rb = raw_async_block(o, raw, static_cast<std::size_t>(c.in_flight));
      r.raw_cpu = r.raw_cpu + (both_cpu() - before);
      r.raw_calls += rb.calls;
    };
    auto do_corpc = [&] {
      ::pthread_setname_np(::pthread_self(), "client-corpc");
      if (!c.async()) return void(cb = latency_block(o, corpc_once));
      const CpuTime before = both_cpu();
      cb = corpc_async_block(o, static_cast<std::size_t>(c.in_flight));
      r.corpc_cpu = r.corpc_cpu + (both_cpu() - before);
      r.corpc_calls += cb.calls;
    };
    if (pair % 2 == 0) {
      do_raw();
      do_corpc();
    } else {
      do_corpc();
      do_raw();
    }
    r.raw_us.insert(r.raw_us.end(), rb.lat_us.begin(), rb.lat_us.end());
    r.corpc_us.insert(r.corpc_us.end(), cb.lat_us.begin(), cb.lat_us.end());
    r.raw_rate.push_back(rb.calls_per_s);
    r.corpc_rate.push_back(cb.calls_per_s);
    r.ratios.push_back(c.async() ? rb.calls_per_s / cb.calls_per_s : median(cb.lat_us) / median(rb.lat_us));
  }
  return r;
}

// ---- --transfers: one echo, four ways ----------------------------------------------------------------------------
// Blocks of each way in a rotating order, so that each sees the same share of the VM's fast and slow phases.
void run_transfers(const Options& o, RawClient& raw) {
  const char* names[] = {"corpc shm", "corpc socket", "raw tcp", "memcpy"};
  fmt::print("{:>8} | {:>10} {:>10} {:>10} {:>10} | {:>9} {:>9} | {:>12} {:>12}\n", "echo", "shm ms", "socket ms",
             "raw ms", "memcpy ms", "shm GB/s", "sock GB/s", "shm/memcpy bw", "sock/shm time");
  for (const auto& c : o.cases) {
    at::Tensor t = at::rand({static_cast<std::int64_t>(c.bytes / sizeof(float))});
    std::vector<char> there(c.bytes), back(c.bytes);
    std::memset(there.data(), 1, c.bytes);
    std::memset(back.data(), 1, c.bytes);
    auto set_paused = [](bool paused) {
      corpc::detail::set_shm_sends_paused(paused);
      corpc::rpc_sync<&pause_same_host>(1, paused);
    };
    auto echo_once = [&] {
      at::Tensor r = corpc::rpc_sync<&echo>(1, t);
      if (r.numel() != t.numel()) throw std::runtime_error("echo returned a tensor of the wrong size");
    };
    std::function<void()> ways[] = {echo_once, echo_once, [&] { raw.round_trip(c.bytes); },
                                    [&] {
                                      std::memcpy(there.data(), t.data_ptr(), c.bytes);
                                      std::memcpy(back.data(), there.data(), c.bytes);
                                    }};
    // Warm-up and checks: the bytes come back, and the shm way really goes through the channel (it is set up
    // alongside the first calls) from its threshold on, the socket way not.
    auto& counters = corpc::detail::shm_counters();
    for (int way = 0; way < 2; ++way) {
      set_paused(way == 1);
      const auto before = counters.messages_received.load();
      for (int i = 0; i < 20; ++i) {
        at::Tensor r = corpc::rpc_sync<&echo>(1, t);
        if (!r.equal(t)) throw std::runtime_error(c.name + ": corpc echo returned a different tensor");
      }
      const auto through = counters.messages_received.load() - before;
      if (way == 0 && through == 0 && c.bytes >= corpc::detail::kShmMinBytes)
        throw std::runtime_error(c.name + ": the same-host channel was not used");
      if (way == 1 && through != 0) throw std::runtime_error(c.name + ": the channel was used while paused");
    }
    raw.round_trip(c.bytes);
    std::vector<double> med[4];
    auto start = Clock::now();
    for (int round = 0; round < 4 || us_since(start) < o.seconds_per_case * 1e6; ++round) {
      for (int k = 0; k < 4; ++k) {
        const int way = (round + k) % 4;
        if (way < 2) set_paused(way == 1);
        med[way].push_back(median(latency_block(o, ways[way]).lat_us));
      }
    }
    set_paused(false);
    double ms[4];
    for (int w = 0; w < 4; ++w) ms[w] = median(med[w]) / 1e3;
    const double gb = 2.0 * static_cast<double>(c.bytes) / 1e9;  // both ways
    fmt::print("{:>8} | {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} | {:>9.2f} {:>9.2f} | {:>12.2f} {:>12.2f}\n", c.name,
               ms[0], ms[1], ms[2], ms[3], gb / (ms[0] / 1e3), gb / (ms[1] / 1e3), ms[3] / ms[0], ms[1] / ms[0]);
  }
  fmt::print(
      "median of per-block medians, {} rotating the order; {} = {}, {} = {}, {} = {}, {} = {}.\n"
      "GB/s: bytes moved both ways per echo / echo time. shm/memcpy bw: the channel's bandwidth as a fraction\n"
      "of a single-threaded memcpy's (memcpy ms / shm ms).\n",
      "blocks of each way", names[0], "RpcOptions::same_host_channel", names[1],
      "the same runtime with its channel paused", names[2], "the raw Asio echo", names[3],
      "memcpy of the tensor there and back on one thread");
}

// ---- reporting --------------------------------------------------------------------------------------------------
std::string blas_info() {
  std::string out;
  char buf[PATH_MAX];
  if (realpath("/usr/lib/x86_64-linux-gnu/libblas.so.3", buf)) {
    out = fmt::format("libblas.so.3 -> {}", buf);
  } else {
    out = "libblas.so.3 not found";
  }
  // What this process actually mapped (libtorch is loaded by now).
  std::ifstream maps("/proc/self/maps");
  std::vector<std::string> seen;
  for (std::string line; std::getline(maps, line);) {
    auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    std::string path = line.substr(slash);
    std::string base = path.substr(path.rfind('/') + 1);
    bool blas = base.find("blas") != std::string::npos || base.find("mkl") != std::string::npos ||
                base.find("lapack") != std::string::npos;
    if (blas && std::find(seen.begin(), seen.end(), path) == seen.end()) seen.push_back(path);
  }
  out += "; mapped:";
  if (seen.empty()) out += " (none)";
  for (auto& p : seen) out += " " + p;
  return out;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "?";
}

int affinity_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  return CPU_COUNT(&set);
}

void print_header(const Options& o) {
  fmt::print("corpc rpc_bench: {} ranks (corpc::launch_processes), 127.0.0.1, libtorch {}, at::get_num_threads()={}\n",
             wants_chain(o.cases) ? 3 : 2, TORCH_VERSION, at::get_num_threads());
  fmt::print("cores: hardware_concurrency={}, affinity={}  cpu: {}\n", std::thread::hardware_concurrency(),
             affinity_cores(), cpu_model());
  fmt::print("blas: {}\n", blas_info());
  fmt::print(
      "per case ~{} s of alternating raw/corpc blocks of ~{} ms (>= {} calls); corpc worker threads: {}; "
      "corpc spin before sleeping: {}; raw receive buffers: {}; flow control limits: {}; corpc over: {}\n\n",
      o.seconds_per_case, o.block_ms, o.min_iters,
      o.worker_threads > 0 ? std::to_string(o.worker_threads) : std::string("default"),
      o.spin_us >= 0 ? fmt::format("{} us", o.spin_us) : std::string("default (50 us)"),
      o.raw_alloc ? "fresh at::empty per message (--raw-alloc)" : "reused",
      o.flow_control ? "defaults" : "off (never bind)",
      o.tls           ? "TLS 1.3 over TCP (--tls)"
      : o.unix_socket ? "a Unix socket"
                      : "TCP (--socket tcp)");
  fmt::print("{:>8} {:>7} {:>7} | {:>10} {:>10} | {:>10} {:>10} | {:>9} {:>13} | {:>10}\n", "case", "blocks", "calls",
             "corpc med", "corpc p99", "raw med", "raw p99", "corpc/raw", "blocks min-max", "corpc MB/s");
  fmt::print("{:>8} {:>7} {:>7} | {:>10} {:>10} | {:>10} {:>10} | {:>9} {:>13} | {:>10}\n", "", "", "", "us", "us",
             "us", "us", "median", "", "");
  fmt::print("{}\n", std::string(118, '-'));
  std::fflush(stdout);
}

double cpu_us_per_call(const CpuTime& t, std::size_t calls) {
  return calls ? static_cast<double>(t.ns) / 1e3 / static_cast<double>(calls) : 0.0;
}
double kernel_percent(const CpuTime& t) {
  const auto ticks = t.user_ticks + t.system_ticks;
  return ticks ? 100.0 * static_cast<double>(t.system_ticks) / static_cast<double>(ticks) : 0.0;
}

void print_row(const CaseResult& r) {
  auto [mn, mx] = std::minmax_element(r.ratios.begin(), r.ratios.end());
  std::string mbps = r.spec.bytes
                         ? fmt::format("{:10.0f}", 2.0 * static_cast<double>(r.spec.bytes) / median(r.corpc_us))
                         : fmt::format("{:>10}", "-");
  fmt::print("{:>8} {:>7} {:>7} | {:10.1f} {:10.1f} | {:10.1f} {:10.1f} | {:9.2f} {:>13} | {}\n", r.spec.name,
             r.ratios.size(), r.corpc_us.size(), median(r.corpc_us), p99(r.corpc_us), median(r.raw_us), p99(r.raw_us),
             median(r.ratios), fmt::format("{:.2f}-{:.2f}", *mn, *mx), mbps);
  if (r.spec.async()) {
    fmt::print(
        "{:>8}   throughput, {} in flight: corpc {:.0f} calls/s, raw {:.0f} msgs/s (medians of blocks); "
        "latency = issue -> consumed\n",
        "", r.spec.in_flight, median(r.corpc_rate), median(r.raw_rate));
    fmt::print(
        "{:>8}   CPU per call, both processes: corpc {:.2f} us ({:.0f}% in the kernel), raw {:.2f} us ({:.0f}%)\n", "",
        cpu_us_per_call(r.corpc_cpu, r.corpc_calls), kernel_percent(r.corpc_cpu),
        cpu_us_per_call(r.raw_cpu, r.raw_calls), kernel_percent(r.raw_cpu));
  }
  std::fflush(stdout);
}

std::string json_array(const std::vector<double>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{:.4f}", i ? ", " : "", v[i]);
  return s + "]";
}

void write_json(const Options& o, const std::vector<CaseResult>& results) {
  std::string s = "{\n";
  s += fmt::format(
      "  \"meta\": {{\"cores\": {}, \"seconds_per_case\": {}, \"block_ms\": {}, \"raw_alloc\": {}, \"tls\": {}, "
      "\"ratio\": \"corpc time / raw "
      "time per call, median over block pairs\"}}",
      std::thread::hardware_concurrency(), o.seconds_per_case, o.block_ms, o.raw_alloc, o.tls.has_value());
  for (auto& r : results) {
    s += fmt::format(
        ",\n  \"{}\": {{\"bytes\": {}, \"median_us\": {:.3f}, \"p99_us\": {:.3f}, \"raw_median_us\": {:.3f}, "
        "\"raw_p99_us\": {:.3f}, \"ratio\": {:.4f}, \"ratio_blocks\": {}, \"iters\": {}",
        r.spec.name, r.spec.bytes, median(r.corpc_us), p99(r.corpc_us), median(r.raw_us), p99(r.raw_us),
        median(r.ratios), json_array(r.ratios), r.corpc_us.size());
    if (r.spec.async()) {
      s += fmt::format(
          ", \"calls_per_s\": {:.1f}, \"raw_calls_per_s\": {:.1f}, \"in_flight\": {}, \"cpu_us_per_call\": {:.3f}, "
          "\"raw_cpu_us_per_call\": {:.3f}, \"kernel_percent\": {:.1f}, \"raw_kernel_percent\": {:.1f}",
          median(r.corpc_rate), median(r.raw_rate), r.spec.in_flight, cpu_us_per_call(r.corpc_cpu, r.corpc_calls),
          cpu_us_per_call(r.raw_cpu, r.raw_calls), kernel_percent(r.corpc_cpu), kernel_percent(r.raw_cpu));
    }
    s += "}";
  }
  s += "\n}\n";
  std::ofstream f(o.json_path);
  f << s;
  if (!f) throw std::runtime_error("cannot write " + o.json_path);
}

// ---- the ranks --------------------------------------------------------------------------------------------------
corpc::RpcOptions rpc_options(const Options& o) {
  corpc::RpcOptions r;
  r.init_timeout = std::chrono::seconds(30);
  r.rpc_timeout = std::chrono::seconds(30);
  r.shutdown_timeout = std::chrono::seconds(30);
  r.num_worker_threads = o.worker_threads;
  r.same_host_channel = o.same_host;
  r.same_host_socket = o.unix_socket;
  if (o.spin_us >= 0) r.spin_before_block = std::chrono::microseconds(o.spin_us);
  if (o.host_cache_mib >= 0)
    corpc::configure_host_memory({.cache_bytes = static_cast<std::uint64_t>(o.host_cache_mib) << 20});
  r.tls = o.tls;
  if (!o.flow_control) {
    r.max_calls_in_flight_per_peer = std::numeric_limits<std::uint32_t>::max();
    r.max_requests_held = std::numeric_limits<std::uint32_t>::max();
    r.receive_budget_per_connection = r.receive_budget_per_process = std::uint64_t{1} << 62;
    r.max_write_backlog_bytes = std::uint64_t{1} << 62;
  }
  return r;
}

// Rank 1 (and rank 2 for the chain case): serves corpc and a raw echo; rank 1 also relays to rank 2 for the chain.
void server_rank(const Options& o, int rank, int world) {
  asio::io_context ctx;
  tcp::acceptor acceptor(ctx, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  tcp::acceptor relay_acceptor(ctx, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  g_raw_port = acceptor.local_endpoint().port();
  g_relay_port = relay_acceptor.local_endpoint().port();
  std::exception_ptr raw_error;
  auto on_error = [&](std::exception_ptr e) {
    if (e && !raw_error) raw_error = e;
  };
  asio::co_spawn(ctx, raw_echo_session(acceptor, o.raw_alloc), on_error);
  auto work = asio::make_work_guard(ctx);  // until the relay is set up
  std::thread raw_thread([&] {
    ::pthread_setname_np(::pthread_self(), "raw-server");
    ctx.run();
  });

  corpc::init_rpc(rank == 1 ? "server" : "server2", rank, world, rpc_options(o));
  if (rank == 1 && world == 3) {
    asio::co_spawn(ctx, raw_relay_session(relay_acceptor, corpc::rpc_sync<&raw_port>(2)), on_error);
  } else {
    asio::post(ctx, [&] { relay_acceptor.close(); });
  }
  work.reset();
  raw_thread.join();  // ends when the client closes its raw connections, after its last case
  corpc::shutdown(true);
  if (raw_error) std::rethrow_exception(raw_error);
}

void client_rank(const Options& o, int world) {
  corpc::init_rpc("client", 0, world, rpc_options(o));
  if (!o.transfers) print_header(o);
  RawClient raw;
  std::size_t max_bytes = 0;
  for (auto& c : o.cases) max_bytes = std::max(max_bytes, c.bytes);
  raw.connect(corpc::rpc_sync<&raw_port>(1), max_bytes, o.raw_alloc);
  RawClient relay;
  if (world == 3) {
    relay.connect(corpc::rpc_sync<&relay_port>(1), 0, false);
  }

  if (o.transfers) {
    run_transfers(o, raw);
    raw.close();
    relay.close();
    corpc::shutdown(true);
    return;
  }
  std::vector<CaseResult> results;
  const int server = corpc::rpc_sync<&server_pid>(1);
  for (auto& c : o.cases) {
    results.push_back(run_case(o, c, raw, relay, server));
    print_row(results.back());
  }
  if (o.cancel_samples > 0) {
    // Time from cancel() here to the callee's coroutine resuming with CancelledError there: a cancel frame, the
    // callee's I/O thread stopping the call's token, and the coroutine's resumption on its pool.
    std::vector<double> us;
    for (int i = 0; i < o.cancel_samples; ++i) {
      auto f = corpc::rpc_async<&park_until_cancelled>(1);
      while (!corpc::rpc_sync<&parked>(1)) {}
      const std::int64_t t0 = now_ns();
      f.cancel();
      std::int64_t seen = 0;
      while ((seen = corpc::rpc_sync<&stop_seen_ns>(1)) == 0) {}
      us.push_back(static_cast<double>(seen - t0) / 1e3);
    }
    fmt::print("cancel -> callee sees it: median {:.1f} us, p99 {:.1f} us over {} cancels\n", median(us), p99(us),
               us.size());
  }
  fmt::print("{}\n", std::string(118, '-'));
  fmt::print(
      "corpc/raw = corpc time per call / raw time per call (async64: raw msgs/s / corpc calls/s), median over block\n"
      "pairs run back to back in ABBA order; > 1 means corpc is slower than the floor. med/p99 pool all blocks.\n"
      "raw = Asio TCP echo between the same two processes: rank 1 serves with a C++20-coroutine loop on one "
      "io_context\n"
      "thread, rank 0 uses blocking asio::write/read, TCP_NODELAY, 8-byte length + payload. remote: against two raw\n"
      "round trips. chain: rank 0 -> 1 -> 2 and back; raw: rank 1 relays on one io_context thread.\n");
  raw.close();
  relay.close();
  if (!o.json_path.empty()) {
    write_json(o, results);
    fmt::print("wrote {}\n", o.json_path);
  }
  corpc::shutdown(true);
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  corpc::LaunchOptions so;
  so.start = corpc::StartMethod::fork;  // the ranks share the parsed options; this process has started no thread
  // Everything must end by itself: a generous bound on the whole run; launch_processes kills the ranks past it.
  so.timeout = std::chrono::seconds(60 + static_cast<long>(o.cases.size() * (3 * o.seconds_per_case + 15)));
  so.grace = std::chrono::seconds(5);
  std::optional<corpc::test::ThrowawayPki> pki;  // removed with its files when the run ends
  if (o.tls && o.tls->certificate_chain_file.empty()) {
    pki.emplace("rpc_bench throwaway CA");
    o.tls = pki->issue("rpc_bench");
  }
  try {
    const int world = wants_chain(o.cases) ? 3 : 2;
    corpc::launch_processes(
        world, [&](int rank) { rank == 0 ? client_rank(o, world) : server_rank(o, rank, world); }, so);
  } catch (const corpc::LaunchError& e) {
    std::fprintf(stderr, "rpc_bench failed: %s\n", e.what());
    for (auto& f : e.failures()) std::fprintf(stderr, "  rank %d: %s\n", f.rank, f.reason.c_str());
    return 1;
  }
  return 0;
}
