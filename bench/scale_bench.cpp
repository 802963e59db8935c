// scale_bench — N ranks on this host, each talking to every other: what set-up costs and what a steady state costs,
// from 8 to 128 ranks (or more, as the host allows).
//
//   ./build/bench/scale_bench                         # 8, 32, 64 and 128 ranks
//   ./build/bench/scale_bench --ranks 8,128 --hops 2000 --repeats 2
//
// Per world size, in one job of N forked processes (rank i is worker "w<i>", default RpcOptions), with a barrier on a
// futex in shared memory between the phases so that each phase starts everywhere at once (phase time = the last
// rank's end - the barrier's release):
//   init        init_rpc, up to every rank's return (rendezvous at rank 0, world table);
//   first a2a   every rank calls `noop` on every other rank, all calls in flight at once: N(N-1) calls, and the
//               N(N-1) connections they open, one per direction (dial on the peer's Unix socket, HMAC handshake,
//               Hello); "µs per new connection" is (first - steady) / N(N-1), wall time on the whole host;
//   steady a2a  the same again, over the connections that are now open;
//   ring        a token passed rank to rank around the ring, `--hops` hops (a chain of awaited calls: each hop is a
//               request out and, at the end, a reply back): µs per hop = time / (2 x hops). One message is in flight
//               at a time, so what it measures is the cost of a message at that world size (lookups, idle peers
//               waking), not CPU contention;
//   shutdown    graceful shutdown, up to every rank's return.
// Then, per rank: open file descriptors, resident memory and its shared part (the same-host channels' rings are
// shared memory; what is resident of them is what has been touched), after the steady phase.
// --handshake-timeout-s sets RpcOptions::handshake_timeout (5 s by default): the set-ups queued at one rank wait
// behind each other, and past 128 ranks on two vCPUs they wait longer than that (a dialer tries twice more before
// its calls fail).
// --noop-on io runs the all-to-alls' `noop` and the ring's hop on the I/O thread its request arrives on
// (CORPC_IO_THREAD_FUNCTION) instead of the worker pool (pool, the default for any function): what the hand-off to a
// pool thread costs at this scale.
// --socket tcp connects the ranks over TCP instead of their Unix sockets (RpcOptions::same_host_socket, on by default).
// --liveness-timeout-ms sets RpcOptions::liveness_timeout (0: no heartbeats): what idle connections' heartbeats cost
// the phases after set-up, where every rank holds 2(N-1) connections.
// --phase-times prints when each phase began (CLOCK_MONOTONIC seconds) on stderr, to cut a profile by phase.
// Ranks are forked, so libtorch's pages are shared between them; a spawned rank would load its own.
#include <dirent.h>
#include <fmt/core.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "corpc/corpc.hpp"

#include "bench_util.hpp"

namespace {

constexpr int kMaxRanks = 1024;

using corpc::bench::futex;
using corpc::bench::now_ns;

struct RankRecord {
  std::int64_t init_end, first_end, steady_end, ring_ns, shutdown_end;
  long fds, rss_kb, shmem_kb;
};

// Lives in a MAP_SHARED mapping made before the ranks are forked.
struct Shared {
  std::atomic<std::uint32_t> arrived;
  std::atomic<std::uint32_t> generation;  // futex word
  std::int64_t released[8];               // when each barrier opened
  RankRecord ranks[kMaxRanks];
};

Shared* g_shared = nullptr;

// All `world` ranks meet; the last to arrive notes the time (barrier number `index`) and wakes the others.
void barrier(int world, int index) {
  const std::uint32_t gen = g_shared->generation.load();
  if (g_shared->arrived.fetch_add(1) + 1 == static_cast<std::uint32_t>(world)) {
    g_shared->arrived.store(0);
    g_shared->released[index] = now_ns();
    g_shared->generation.fetch_add(1);
    futex(&g_shared->generation, FUTEX_WAKE, INT32_MAX);
    return;
  }
  while (g_shared->generation.load() == gen) futex(&g_shared->generation, FUTEX_WAIT, gen);
}

long count_fds() {
  long n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++n;
    closedir(d);
  }
  return n - 3;  // ".", ".." and the directory's own descriptor
}

long status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key, 0) == 0) return std::stol(line.substr(std::strlen(key)));
  return -1;
}

// ---- the remote functions ---------------------------------------------------------------------------------------
void noop() {}
void noop_on_io_thread() {}  // the same, run where its request arrives (--noop-on io)
bool g_noop_on_io = false;

int g_world = 0;
corpc::Task<void> hop(int left) {
  if (left > 0) co_await corpc::rpc_async<&hop>((corpc::Runtime::get().rank() + 1) % g_world, left - 1);
}
corpc::Task<void> hop_on_io_thread(int left) {  // the same, run where its request arrives (--noop-on io)
  if (left > 0) co_await corpc::rpc_async<&hop_on_io_thread>((corpc::Runtime::get().rank() + 1) % g_world, left - 1);
}

void all_to_all(int rank, int world) {
  std::vector<corpc::Future<void>> calls;
  calls.reserve(static_cast<std::size_t>(world));
  for (int peer = 0; peer < world; ++peer)
    if (peer != rank)
      calls.push_back(g_noop_on_io ? corpc::rpc_async<&noop_on_io_thread>(peer) : corpc::rpc_async<&noop>(peer));
  corpc::when_all(std::move(calls)).wait();
}

void run_rank(int rank, int world, int hops, const corpc::RpcOptions& options) {
  g_world = world;
  RankRecord& me = g_shared->ranks[rank];
  barrier(world, 0);
  corpc::init_rpc(fmt::format("w{}", rank), rank, world, options);
  me.init_end = now_ns();
  barrier(world, 1);
  all_to_all(rank, world);
  me.first_end = now_ns();
  barrier(world, 2);
  all_to_all(rank, world);
  me.steady_end = now_ns();
  me.fds = count_fds();
  me.rss_kb = status_kb("VmRSS:");
  me.shmem_kb = status_kb("RssShmem:");
  barrier(world, 3);
  if (rank == 0) {
    const auto t0 = now_ns();
    if (g_noop_on_io) corpc::rpc_sync<&hop_on_io_thread>(1 % world, hops - 1);
    else corpc::rpc_sync<&hop>(1 % world, hops - 1);
    me.ring_ns = now_ns() - t0;
  }
  barrier(world, 4);
  corpc::shutdown();
  me.shutdown_end = now_ns();
}

double seconds(std::int64_t ns) { return static_cast<double>(ns) / 1e9; }

template <class F>
std::int64_t last(int world, F field) {
  std::int64_t t = 0;
  for (int r = 0; r < world; ++r) t = std::max(t, field(g_shared->ranks[r]));
  return t;
}

template <class F>
long median_of(int world, F field) {
  std::vector<long> v;
  for (int r = 0; r < world; ++r) v.push_back(field(g_shared->ranks[r]));
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

CORPC_IO_THREAD_FUNCTION(&noop_on_io_thread);
CORPC_IO_THREAD_FUNCTION(&hop_on_io_thread);

namespace {

int run(int argc, char** argv) {
  corpc::bench::Flags flags(
      argc, argv,
      {"ranks", "hops", "repeats", "timeout-s", "handshake-timeout-s", "noop-on", "socket", "liveness-timeout-ms"},
      {"phase-times"});
  flags.check();
  const std::string noop_on = flags.get("noop-on", "pool");
  if (noop_on != "pool" && noop_on != "io") throw std::runtime_error("--noop-on: pool or io");
  g_noop_on_io = noop_on == "io";
  const std::vector<long> sizes = flags.get_list("ranks", "8,32,64,128");
  const int hops = flags.get_int<int>("hops", 1000);
  const int repeats = flags.get_int<int>("repeats", 1);
  corpc::RpcOptions options;
  options.handshake_timeout = std::chrono::seconds(flags.get_int("handshake-timeout-s", 5));
  const std::string socket = flags.get("socket", "unix");
  if (socket != "unix" && socket != "tcp") throw std::runtime_error("--socket: unix or tcp");
  options.same_host_socket = socket == "unix";
  options.liveness_timeout = std::chrono::milliseconds(
      flags.get_int<long>("liveness-timeout-ms", static_cast<long>(options.liveness_timeout.count())));
  corpc::LaunchOptions launch;
  launch.start = corpc::StartMethod::fork;
  launch.timeout = std::chrono::seconds(flags.get_int("timeout-s", 300));

  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("mmap failed");
  g_shared = new (mem) Shared{};

  std::printf(
      "| ranks | init s | first a2a s | steady a2a s | first/steady | µs per new connection (host) | ring µs/hop "
      "| shutdown s | fds/rank | RSS MiB/rank | shared MiB/rank |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int repeat = 0; repeat < repeats; ++repeat) {
    for (const long size : sizes) {
      const int world = static_cast<int>(size);
      if (world < 2 || world > kMaxRanks)
        throw std::runtime_error("--ranks: each size in 2.." + std::to_string(kMaxRanks));
      std::memset(static_cast<void*>(g_shared->ranks), 0, sizeof(g_shared->ranks));
      corpc::launch_processes(
          world, [&](int rank) { run_rank(rank, world, hops, options); }, launch);
      const auto* rel = g_shared->released;
      const double init = seconds(last(world, [](auto& r) { return r.init_end; }) - rel[0]);
      const double first = seconds(last(world, [](auto& r) { return r.first_end; }) - rel[1]);
      const double steady = seconds(last(world, [](auto& r) { return r.steady_end; }) - rel[2]);
      const double shut = seconds(last(world, [](auto& r) { return r.shutdown_end; }) - rel[4]);
      const double connections = world * (world - 1.0);  // each rank dials each other: a connection per direction
      std::printf("| %d | %.3f | %.3f | %.3f | %.1f | %.0f | %.1f | %.3f | %ld | %.0f | %.0f |\n", world, init, first,
                  steady, first / steady, (first - steady) / connections * 1e6,
                  static_cast<double>(g_shared->ranks[0].ring_ns) / 1e3 / (2.0 * hops), shut,
                  median_of(world, [](auto& r) { return r.fds; }),
                  median_of(world, [](auto& r) { return r.rss_kb; }) / 1024.0,
                  median_of(world, [](auto& r) { return r.shmem_kb; }) / 1024.0);
      if (flags.has("phase-times"))  // CLOCK_MONOTONIC seconds, e.g. for `perf record -k CLOCK_MONOTONIC` + --time
        std::fprintf(stderr, "# %d ranks: init %.6f first %.6f steady %.6f ring %.6f shutdown %.6f end %.6f\n", world,
                     seconds(rel[0]), seconds(rel[1]), seconds(rel[2]), seconds(rel[3]), seconds(rel[4]),
                     seconds(last(world, [](auto& r) { return r.shutdown_end; })));
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

// A failed job (a rank's error, a bad flag) ends as an exit status of 1 with the reason, not as an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "scale_bench: %s\n", e.what());
    return 1;
  }
}
