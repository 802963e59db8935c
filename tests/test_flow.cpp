// Flow control and liveness: a slow consumer's memory stays within its receive budget while a producer
// floods it, oversized requests fail typed, calls to one peer wait for room, and a silent peer is declared gone.
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <thread>

#include "stopped_worker.hpp"
#include "support.hpp"

namespace test_flow {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

constexpr std::uint64_t kMiB = 1 << 20;

std::int64_t rss_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<std::int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

// ---- the consumer's side of the flood ----
constexpr int kMaxCalls = 600;
std::array<std::atomic<int>, kMaxCalls> g_seen{};  // how often each call arrived
std::atomic<bool> g_slow{true};
std::atomic<std::chrono::steady_clock::time_point> g_stalled_until{};  // the consumer takes nothing before this
std::atomic<bool> g_sampling{false};
std::atomic<std::int64_t> g_rss_base{0}, g_rss_peak{0};
std::thread g_sampler;

std::int64_t consume(std::int64_t seq, at::Tensor t) {
  if (seq >= 0 && seq < kMaxCalls) g_seen[seq]++;
  while (std::chrono::steady_clock::now() < g_stalled_until.load()) std::this_thread::sleep_for(1ms);
  if (g_slow) std::this_thread::sleep_for(2ms);
  return seq + t.numel();
}

// Starts watching this process's RSS; the consumer stalls for `stall_ms`, then works slowly.
void start_sampling(int stall_ms) {
  g_rss_base = g_rss_peak = rss_bytes();
  g_stalled_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(stall_ms);
  g_sampling = true;
  g_sampler = std::thread([] {
    while (g_sampling) {
      std::int64_t now = rss_bytes(), peak = g_rss_peak.load();
      while (now > peak && !g_rss_peak.compare_exchange_weak(peak, now)) {}
      std::this_thread::sleep_for(1ms);
    }
  });
}

// {calls not seen exactly once among the first n, RSS growth at the peak}
std::vector<std::int64_t> stop_sampling(int n) {
  g_sampling = false;
  if (g_sampler.joinable()) g_sampler.join();
  std::int64_t bad = 0;
  for (int i = 0; i < n; ++i) bad += g_seen[i].load() != 1;
  return {bad, g_rss_peak.load() - g_rss_base.load()};
}

void set_slow(bool slow) { g_slow = slow; }

// ---- calls in flight ----
std::atomic<int> g_running{0}, g_most_running{0};
int held(int i) {
  int now = ++g_running, most = g_most_running.load();
  while (now > most && !g_most_running.compare_exchange_weak(most, now)) {}
  std::this_thread::sleep_for(5ms);
  --g_running;
  return i;
}
int most_running() { return g_most_running.exchange(0); }

Task<int> issue_and_await(int to, int n) {
  std::vector<Future<int>> calls;
  for (int i = 0; i < n; ++i) calls.push_back(rpc_async<&held>(to, i));  // past the limit: waits, holds no thread
  int sum = 0;
  for (auto& f : calls) sum += co_await f;
  co_return sum;
}

// One call to rank `to` takes the only room (it sleeps 1 s); the next, with a 200 ms timeout, waits for room,
// holding no thread, and times out unsent. Returns that error's text.
int sleep_ms(int ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  return ms;
}
Task<std::string> second_call_times_out_waiting(int to) {
  auto first = rpc_async<&sleep_ms>(to, 1000);
  auto second = rpc_async<&sleep_ms>(to, with_timeout(200ms), 0);
  std::string what;
  try {
    co_await second;
  } catch (const TimeoutError& e) {
    what = e.what();
  }
  co_await first;
  co_return what;
}

// ---- nested calls: made by handlers, on behalf of the requests they serve ----
// A chain bouncing between ranks `here` and `there`, `depth` calls deep: every handler awaits the next call.
Task<int> bounce(int here, int there, int depth) {
  if (depth == 0) co_return 0;
  co_return 1 + co_await rpc_async<&bounce>(there, there, here, depth - 1);
}

// A handler that calls on to rank `next` and awaits it. The pause first holds the handler until every rank of the
// cycle has issued its own calls, so that those take all the room on every link before any nested call is made.
Task<int> relay(int next, int i) {
  std::this_thread::sleep_for(300ms);
  co_return co_await rpc_async<&sleep_ms>(next, i % 3);
}
Task<int> relay_round(int next, int after, int n) {
  std::vector<Future<int>> calls;
  for (int i = 0; i < n; ++i) calls.push_back(rpc_async<&relay>(next, after, i));
  int sum = 0;
  for (auto& f : calls) sum += co_await f;
  co_return sum;
}

// ---- a dial to a peer too busy to answer its handshake in time ----
Task<int> first_call_to(int to) { co_return co_await rpc_async<&pid_of_rank>(to); }

}  // namespace

TEST_CASE("a producer flooding a slow consumer: the consumer's memory stays within its budget, no call is lost") {
  // The consumer may hold 16 MiB of requests; the producer sends 1 MiB tensors as fast as it can for up to 1.5 s
  // (up to kMaxCalls calls; 600 MiB if nothing held them back). The consumer takes nothing for the first 1.5 s, then
  // 2 ms per call on 2 threads: without the budget it reads on at TCP's pace (over 100 MiB/s even on a loaded VM).
  constexpr std::uint64_t kBudget = 16 * kMiB;
  // Margin for what the budget does not cover: the allocator keeps freed chunks in per-thread arenas (allocation on
  // the I/O thread, release on pool threads), 64 KiB read buffers, thread stacks touched for the first time.
  constexpr std::int64_t kMargin = 48 * kMiB;
  auto options = quick_options();
  options.receive_budget_per_process = kBudget;
  options.receive_budget_per_connection = kBudget;
  options.num_worker_threads = 2;
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        const auto tensor = at::ones({static_cast<std::int64_t>(kMiB / sizeof(float))});
        for (int i = 0; i < 8; ++i) rpc_sync<&consume>(1, -1, tensor);  // warm the consumer's allocator up
        rpc_sync<&start_sampling>(1, 1500);
        std::vector<Future<std::int64_t>> calls;
        const auto flood_start = std::chrono::steady_clock::now();
        const auto until = flood_start + 1500ms;
        while (calls.size() < kMaxCalls && std::chrono::steady_clock::now() < until)
          calls.push_back(rpc_async<&consume>(1, static_cast<std::int64_t>(calls.size()), tensor));
        for (std::size_t i = 0; i < calls.size(); ++i)
          EXPECT_EQ(calls[i].wait(), static_cast<std::int64_t>(i) + tensor.numel());
        const auto drained = std::chrono::steady_clock::now();
        const auto report = rpc_sync<&stop_sampling>(1, static_cast<int>(calls.size()));
        MESSAGE("flood: " << calls.size() << " calls of 1 MiB, consumer RSS grew by " << report[1] / kMiB
                          << " MiB (budget " << kBudget / kMiB << " MiB + margin " << kMargin / kMiB << ")");
        EXPECT_EQ(report[0], 0);  // every call arrived exactly once
        EXPECT(report[1] < static_cast<std::int64_t>(kBudget) + kMargin);
        // The consumer catches up: the paused connection reads again and a fast consumer takes calls at full speed.
        rpc_sync<&set_slow>(1, false);
        const auto again = std::chrono::steady_clock::now();
        std::vector<Future<std::int64_t>> more;
        for (int i = 0; i < 200; ++i) more.push_back(rpc_async<&consume>(1, -1, tensor));
        for (auto& f : more) EXPECT_EQ(f.wait(), -1 + tensor.numel());
        const auto secs = [](auto d) { return std::chrono::duration<double>(d).count(); };
        MESSAGE("slow consumer: " << calls.size() / secs(drained - flood_start) << " calls/s; after it caught up: "
                                  << 200 / secs(std::chrono::steady_clock::now() - again) << " calls/s");
      },
      options);
}

TEST_CASE("a request larger than the receiver's whole budget fails with MessageTooLargeError, the peer stays") {
  auto options = quick_options();
  options.receive_budget_per_connection = 8 * kMiB;
  options.receive_budget_per_process = 16 * kMiB;
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        const auto big = at::ones({static_cast<std::int64_t>(12 * kMiB / sizeof(float))});
        // The first call on a new connection leaves before the receiver's Hello (with its budget) is back: the receiver
        // drops its bytes and answers; the second is refused by the sender, which knows the budget by then.
        for (int i = 0; i < 2; ++i) {
          auto msg = EXPECT_THROWS_AS(rpc_async<&consume>(1, -1, big).wait(30s), MessageTooLargeError);
          EXPECT(msg.find("receive_budget") != std::string::npos);
        }
        const auto fits = at::ones({static_cast<std::int64_t>(4 * kMiB / sizeof(float))});
        EXPECT_EQ(rpc_sync<&consume>(1, -1, fits), -1 + fits.numel());
        EXPECT(Runtime::get().is_alive(1));
      },
      options);
}

TEST_CASE("calls to one peer beyond the limit wait for room: a blocking caller blocks, a coroutine suspends") {
  auto options = quick_options();
  options.max_calls_in_flight_per_peer = 4;
  options.num_worker_threads = 8;  // the callee could run 8 at once: only the caller's limit keeps it at 4
  run_world(
      2,
      [](int rank) {
        // Both ways: rank 0 calls rank 1 on a connection it dialed, rank 1 calls rank 0 on the one it registered
        // through.
        const int to = 1 - rank;
        constexpr int kCalls = 40;
        std::vector<Future<int>> calls;
        for (int i = 0; i < kCalls; ++i) calls.push_back(rpc_async<&held>(to, i));  // main blocks at the limit
        for (int i = 0; i < kCalls; ++i) EXPECT_EQ(calls[i].wait(), i);
        EXPECT(rpc_sync<&most_running>(to) <= 4);
        EXPECT_EQ(sync_wait(issue_and_await(to, kCalls)), kCalls * (kCalls - 1) / 2);
        EXPECT(rpc_sync<&most_running>(to) <= 4);
        EXPECT_EQ(Runtime::get().stats().calls_in_flight, 0u);
      },
      options);
}

TEST_CASE("a call that times out waiting for room says so, and names the limit") {
  auto options = quick_options();
  options.max_calls_in_flight_per_peer = 1;
  run_world(
      2,
      [](int rank) {
        if (rank != 0) return;
        const std::string what = sync_wait(second_call_times_out_waiting(1));  // a coroutine: it suspends for room
        MESSAGE(what);
        EXPECT(what.find("waiting for room") != std::string::npos);
        EXPECT(what.find("max_calls_in_flight_per_peer") != std::string::npos);
        EXPECT_EQ(rpc_sync<&sleep_ms>(1, 0), 0);  // the connection goes on
      },
      options);
}

TEST_CASE("calls made by handlers are not held back by the limit: nested chains deeper than it finish") {
  auto options = quick_options();
  options.max_calls_in_flight_per_peer = 2;
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        // Nine calls deep: each link holds four or five of them unanswered, above the limit. Between ranks 1 and 2
        // (connections they dialed), and between ranks 1 and 0 (rank 1 reaches rank 0 on its registration
        // connection).
        EXPECT_EQ(rpc_sync<&bounce>(1, 1, 2, 9), 9);
        EXPECT_EQ(rpc_sync<&bounce>(1, 1, 0, 9), 9);
        // The program's own calls are still bounded.
        std::vector<Future<int>> calls;
        for (int i = 0; i < 12; ++i) calls.push_back(rpc_async<&held>(1, i));
        for (int i = 0; i < 12; ++i) EXPECT_EQ(calls[i].wait(), i);
        EXPECT(rpc_sync<&most_running>(1) <= 2);
      },
      options);
}

TEST_CASE("a cycle of handlers through three ranks, every link at the limit with the ranks' own calls, finishes") {
  // Ranks 1, 2, 3 each send 16 calls to the next; each handler calls on to the rank after and awaits it. The ranks'
  // own calls fill every link's room (2); a nested call that waited for room behind them would wait on replies that
  // wait on it, around the cycle, until the timeout.
  auto options = quick_options();
  options.max_calls_in_flight_per_peer = 2;
  run_world(
      4,
      [](int rank) {
        if (rank == 0) return;
        const auto next = [](int r) { return r % 3 + 1; };  // 1 -> 2 -> 3 -> 1
        constexpr int kCalls = 16;
        int expected = 0;
        for (int i = 0; i < kCalls; ++i) expected += i % 3;
        EXPECT_EQ(sync_wait(relay_round(next(rank), next(next(rank)), kCalls)), expected);
      },
      options);
}

TEST_CASE("a stopped worker (SIGSTOP) is declared unreachable; its peers' calls fail and their shutdown completes") {
  auto options = quick_options();
  options.liveness_timeout = 1s * time_scale();  // short for the test (the default is 15 s); stretched when sanitized
  options.rpc_timeout = 60s;       // longer than the test allows: only the liveness check can end these calls
  options.shutdown_timeout = 0ms;  // as long as the others are alive: only the death of worker2 lets it end
  expect_stopped_worker2_declared_unreachable(options);
}

TEST_CASE("a dial whose handshake stalls on a peer that is only busy is tried again, and its call gets through") {
  // Rank 2 is stopped (SIGSTOP: its kernel still accepts connections, nobody answers) while rank 1 dials it for the
  // first time; it goes on before rank 1's second attempt times out. A peer that is only slow to get a CPU (hundreds
  // of ranks on a few cores) looks the same to the dialer.
  auto options = quick_options();
  options.handshake_timeout = 1s * time_scale();
  run_world(
      3,
      [&](int rank) {
        if (rank != 0) return;
        const int victim = rpc_sync<&pid_of_rank>(2);
        REQUIRE(::kill(victim, SIGSTOP) == 0);
        wait_until_stopped(victim);
        auto call = rpc_async<&first_call_to>(1, 2);  // rank 1 has not called rank 2 before: it dials now
        std::this_thread::sleep_for(options.handshake_timeout * 3 / 2);
        ::kill(victim, SIGCONT);
        EXPECT_EQ(call.wait(), victim);
        EXPECT(Runtime::get().is_alive(2));
      },
      options);
}

TEST_CASE("a registration whose handshake stalls on a rank 0 that is only busy is tried again, and the job starts") {
  // Rank 0 is stopped (SIGSTOP: the socket the launcher bound for it still accepts, nobody answers) while rank 1 makes
  // its first connection to it, and goes on before rank 1's second attempt times out. A rank 0 that is only slow to get
  // a CPU (a loaded machine, hundreds of registrations at once) looks the same: its handshake timing out must not end
  // the job, as a wrong secret does.
  auto options = quick_options();
  options.handshake_timeout = 1s * time_scale();
  const std::string pid_file = "/tmp/corpc-test-flow-rank0-" + std::to_string(::getpid());
  struct Removed {
    const std::string& path;
    ~Removed() { std::remove(path.c_str()); }  // in this process, however the launch ended
  } removed{pid_file};
  launch_processes(
      2,
      [&](int rank) {
        if (rank == 0) {
          if (FILE* f = std::fopen((pid_file + ".tmp").c_str(), "w")) {
            std::fprintf(f, "%d\n", static_cast<int>(::getpid()));
            std::fclose(f);
          }
          std::rename((pid_file + ".tmp").c_str(), pid_file.c_str());  // whole or absent for the reader
          init_rpc(worker_name(0), 0, 2, options);
          shutdown(true);
          return;
        }
        int master = 0;
        for (const auto give_up = std::chrono::steady_clock::now() + 60s; master <= 0;) {
          if (FILE* f = std::fopen(pid_file.c_str(), "r")) {
            if (std::fscanf(f, "%d", &master) != 1) master = 0;
            std::fclose(f);
          }
          EXPECT(std::chrono::steady_clock::now() < give_up);
          std::this_thread::sleep_for(1ms);
        }
        std::remove(pid_file.c_str());
        stop_process(master);
        std::thread resume([&] {
          std::this_thread::sleep_for(options.handshake_timeout * 3 / 2);
          ::kill(master, SIGCONT);
        });
        try {
          init_rpc(worker_name(1), 1, 2, options);
        } catch (...) {
          resume.join();
          throw;
        }
        resume.join();
        EXPECT_EQ(rpc_sync<&pid_of_rank>(0), master);
        shutdown(true);
      },
      launch_options(120s));
}

}  // namespace test_flow
