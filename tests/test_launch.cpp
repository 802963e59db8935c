// How ranks start and how they end: launch_processes' start methods (spawn runs this binary again, so every case
// here also runs, replayed, in the ranks of the cases after it), a launcher's RANK, and ranks that leave without
// shutdown() or after an error. Each exit path must end without a signal, and no rank of a failed job may exit 0.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <torch/csrc/autograd/autograd.h>
#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "support.hpp"
#include "transport/rank_identity.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

int add(int a, int b) { return a + b; }

LaunchOptions spawned(std::chrono::seconds timeout = 120s) {
  LaunchOptions o = launch_options(timeout, 10s);
  o.start = StartMethod::spawn;
  return o;
}

// The kernel's count ("Threads:" in /proc/self/status).
int threads_here() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return 0;
}

// Parallel ATen work and a backward: what starts libtorch's intra-op threads and autograd workers.
double train_a_little() {
  at::set_num_threads(2);
  auto a = at::randn({512, 512});
  auto w = at::randn({512, 512}).requires_grad_(true);
  for (int i = 0; i < 4; ++i) a = at::tanh(a.mm(w));
  auto loss = a.pow(2).mean();
  torch::autograd::backward({loss});
  return w.grad().abs().sum().item<double>();
}

// Calls `rank` until its death fails the call: its threads can serve calls before its main thread dies.
void call_until_lost(int rank) {
  try {
    for (;;) (void)rpc_sync<&add>(rank, 1, 1);
  } catch (const ConnectionError&) {}
}

// A rank of a job that goes on without `lost` (lost_rank_fails_shutdown off): joins the job, then `lost` dies and
// the others wait until they see it gone.
void join_then_lose(int rank, int lost) {
  auto options = quick_options();
  options.lost_rank_fails_shutdown = false;
  init_rpc(worker_name(rank), -1, -1, options);
  if (rank == lost) ::raise(SIGKILL);
  call_until_lost(lost);
}

// A failure's reason for `rank` (empty if that rank did not fail).
std::string reason_of(const LaunchError& e, int rank) {
  for (auto& f : e.failures())
    if (f.rank == rank) return f.reason;
  return {};
}

// Set by the first case when its failed launch threw: a spawned rank of a later case must have replayed that.
bool g_first_launch_failed = false;

// Where the ranks of a restart case record their processes: a fresh directory made by the caller, found by its spawned
// ranks (which run the case again from its start) in the environment it passes on.
std::string restart_record_dir() {
  if (!launched_rank()) {
    std::string pattern = (std::filesystem::temp_directory_path() / "corpc-restart.XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    ::setenv("CORPC_TEST_RESTART_DIR", pattern.c_str(), 1);
  }
  const char* dir = std::getenv("CORPC_TEST_RESTART_DIR");
  return dir ? dir : "";
}

// One line per process that ran `rank`: its CORPC_RANK_RESTART and CORPC_REJOIN ("-" where unset).
void record_process(const std::string& dir, int rank) {
  auto value = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "-");
  };
  std::ofstream(dir + "/rank" + std::to_string(rank), std::ios::app)
      << value("CORPC_RANK_RESTART") << " " << value("CORPC_REJOIN") << "\n";
}

// The lines record_process wrote for `rank`, one per process, in order.
std::vector<std::string> processes_of(const std::string& dir, int rank) {
  std::vector<std::string> lines;
  std::ifstream in(dir + "/rank" + std::to_string(rank));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Three ranks; rank 1 kills itself in its first process only. Rank 0 waits for rank 1's second process, so the job
// succeeds only if rank 1 was restarted while the others kept running.
void killed_rank_restarts_in_place(StartMethod start) {
  const std::string dir = restart_record_dir();
  LaunchOptions options = launch_options(120s, 10s);
  options.start = start;
  options.max_rank_restarts = 1;
  launch_processes(
      3,
      [dir](int rank) {
        record_process(dir, rank);
        if (launching_process()) throw std::runtime_error("a rank says it is the launching process");
        if (rank == 1 && rank_restart_count() == 0) {
          if (rejoining()) throw std::runtime_error("a first process says it rejoins");
          ::raise(SIGKILL);
        }
        if (rank == 1) {
          if (rank_restart_count() != 1 || !rejoining())
            throw std::runtime_error("the restarted rank does not know it is restart 1 and rejoins");
        } else if (rank_restart_count() != 0 || rejoining()) {
          throw std::runtime_error("rank " + std::to_string(rank) + " was not expected to be restarted");
        }
        if (rank == 0)
          while (processes_of(dir, 1).size() < 2) std::this_thread::sleep_for(10ms);  // bounded by the timeout
      },
      options);
  if (launched_rank()) return;  // a replay: the caller checks
  CHECK(processes_of(dir, 0) == std::vector<std::string>{"- -"});
  CHECK(processes_of(dir, 1) == std::vector<std::string>{"- -", "1 1"});
  CHECK(processes_of(dir, 2) == std::vector<std::string>{"- -"});
  std::filesystem::remove_all(dir);
}

// Whether this process's memory holds a launcher key that deals `credential` to this start of `rank`: every
// 64-character window of lowercase hex (a key as the launcher writes it) in every readable mapping, read through
// /proc/self/mem (a mapping that cannot be read there, such as the vsyscall page, is skipped page by page). A key
// anywhere (heap, stacks, environment, libraries' data, a wiped page) is found, whatever copy of it survived.
bool memory_holds_key_for(const std::string& credential, int rank, std::uint32_t incarnation) {
  // Runs in a forked rank: a failure is thrown, for the launcher to report.
  const int mem = ::open("/proc/self/mem", O_RDONLY | O_CLOEXEC);
  if (mem < 0) throw std::runtime_error("cannot open /proc/self/mem");
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, perms;
    fields >> range >> perms;
    if (perms.empty() || perms[0] != 'r') continue;
    const auto dash = range.find('-');
    ranges.emplace_back(std::stoull(range.substr(0, dash), nullptr, 16),
                        std::stoull(range.substr(dash + 1), nullptr, 16));
  }
  if (ranges.empty()) throw std::runtime_error("no readable mapping in /proc/self/maps");
  constexpr std::size_t kChunk = 1 << 20, kPage = 4096;
  std::vector<char> buffer(kChunk);
  std::array<char, 64> window{};  // the last hex characters seen, in order
  std::size_t run = 0;            // how many hex characters in a row end at the current one
  bool found = false;
  auto scan = [&](const char* bytes, std::size_t n) {
    for (std::size_t i = 0; i < n && !found; ++i) {
      const char c = bytes[i];
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {
        run = 0;
        continue;
      }
      std::memmove(window.data(), window.data() + 1, window.size() - 1);
      window.back() = c;
      if (++run >= window.size())
        found = corpc::detail::rank_credential({window.data(), window.size()}, rank, incarnation) == credential;
    }
  };
  for (auto [begin, end] : ranges) {
    run = 0;
    for (std::uintptr_t at = begin; at < end && !found; at += kChunk) {
      const std::size_t n = std::min<std::uintptr_t>(kChunk, end - at);
      if (::pread(mem, buffer.data(), n, static_cast<off_t>(at)) == static_cast<ssize_t>(n)) {
        scan(buffer.data(), n);
        continue;
      }
      for (std::size_t page = 0; page < n && !found; page += kPage) {  // some of it cannot be read
        if (::pread(mem, buffer.data(), kPage, static_cast<off_t>(at + page)) == static_cast<ssize_t>(kPage))
          scan(buffer.data(), kPage);
        else run = 0;
      }
    }
  }
  ::close(mem);
  return found;
}

}  // namespace

// First: StartMethod::fork needs a caller that has not started threads yet (the next cases start libtorch's).
TEST_CASE("a forked rank killed by a signal is forked again in place, with CORPC_REJOIN, and the job succeeds") {
  killed_rank_restarts_in_place(StartMethod::fork);
}

// Also before any thread: a rank forked from the launcher would inherit the run's key with the rest of its memory.
TEST_CASE("no forked rank but rank 0 holds the launcher's key, first starts and restarts alike") {
  // Rank 2 dies in its first start, so that its restart (incarnation 1) is forked later, from a launcher that has by
  // then dealt every other start. Rank 0 holds the key by design (CORPC_RANK_KEY): its finding it shows that the scan
  // finds a key that is there.
  LaunchOptions options = launch_options(120s, 10s);
  options.max_rank_restarts = 1;
  launch_processes(
      3,
      [](int rank) {
        if (rank == 2 && rank_restart_count() == 0) ::raise(SIGKILL);
        const char* credential = std::getenv("CORPC_RANK_CREDENTIAL");
        if (!credential || std::strlen(credential) != 64) throw std::runtime_error("no CORPC_RANK_CREDENTIAL");
        const bool holds = memory_holds_key_for(credential, rank, static_cast<std::uint32_t>(rank_restart_count()));
        if (rank == 0 && !holds) throw std::runtime_error("rank 0's scan did not find the key it was given");
        if (rank != 0 && holds)
          throw std::runtime_error("rank " + std::to_string(rank) + " (restart " +
                                   std::to_string(rank_restart_count()) + ") holds the launcher's key");
      },
      options);
}

TEST_CASE("spawned ranks run this program again; a failed rank is named with its error") {
  try {
    launch_processes(
        2,
        [](int rank) {
          if (rank == 1) throw std::runtime_error("boom from rank 1");
        },
        spawned());
    FAIL("rank 1 was expected to fail");
  } catch (const LaunchError& e) {
    g_first_launch_failed = true;
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 1);
    CHECK(e.failures()[0].reason == "boom from rank 1");
  }
  launch_processes(
      3,
      [](int rank) {
        // A new process that started from main (a fork would not know a launched rank), told its rank.
        if (launched_rank() != rank) throw std::runtime_error("launched_rank() does not say this rank");
        if (launching_process()) throw std::runtime_error("a spawned rank says it is the launching process");
        if (!g_first_launch_failed) throw std::runtime_error("the earlier launch's failure was not replayed");
        init_rpc(worker_name(rank), -1, -1, quick_options());
        if (rpc_sync<&add>((rank + 1) % 3, rank, 10) != rank + 10) throw std::runtime_error("wrong sum");
        shutdown();
      },
      spawned());
}

TEST_CASE("a caller whose libtorch runs threads still launches; fork refuses it with a clear error") {
  // In the ranks of later cases this runs again: skip the work, keep the launches (they are replayed).
  double expected = 0;
  if (!launched_rank()) {
    const int before = threads_here();
    expected = train_a_little();
    REQUIRE(threads_here() > before);  // the situation this case is about: libtorch has started its threads
  }
  // With fork, each rank hung in the parent's OpenMP pool (libtorch 1.13) or autograd (2.6) until the timeout.
  launch_processes(
      2,
      [](int) {
        if (!(train_a_little() > 0)) throw std::runtime_error("no gradient");
      },
      spawned(120s));
  LaunchOptions forked = launch_options(60s, 5s);
  CHECK_THROWS_WITH_AS(launch_processes(
                           2, [](int) {}, forked),
                       doctest::Contains("StartMethod::fork refused"), UsageError);
  if (!launched_rank()) CHECK(expected > 0);
}

TEST_CASE("a rank that leaves without shutdown() is shut down gracefully for it, without a signal") {
  // Rank 1 returns from its function; rank 2 exits the process (as a main that returns) with the runtime running.
  launch_processes(
      3,
      [](int rank) {
        init_rpc(worker_name(rank), -1, -1, quick_options());
        if (rank == 0) {
          for (int r = 1; r < 3; ++r)
            if (rpc_sync<&add>(r, r, 1) != r + 1) throw std::runtime_error("wrong sum");
          shutdown();
        } else if (rank == 2) {
          std::exit(0);
        }
      },
      spawned());
}

TEST_CASE("a job that lost a rank fails on every rank, and the rank that leaves after the error exits cleanly") {
  try {
    launch_processes(
        3,
        [](int rank) {
          init_rpc(worker_name(rank), -1, -1, quick_options());
          if (rank == 1) ::raise(SIGKILL);
          if (rank == 0) {
            call_until_lost(1);
            std::exit(
                1);  // what a main that catches the ConnectionError, reports and returns 1 does, without shutdown()
          }
          shutdown();  // rank 2: the job lost rank 1, so this must not end as a success
        },
        spawned());
    FAIL("the job was expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    CHECK(reason_of(e, 1).find("killed by signal") != std::string::npos);
    CHECK(reason_of(e, 0) == "exited with code 1");
    const std::string survivor = reason_of(e, 2);
    CHECK(survivor.find("worker1") != std::string::npos);
    CHECK(survivor.find("signal") == std::string::npos);
  }
}

TEST_CASE(
    "with lost_rank_fails_shutdown off, the survivors of a lost rank shut down cleanly; rank 0's loss still fails") {
  // What a fault-tolerant job under srun or mpirun (no replacement) does: rank 1 dies, ranks 0 and 2 end as successes.
  try {
    launch_processes(
        3,
        [](int rank) {
          join_then_lose(rank, 1);
          if (rpc_sync<&add>(2 - rank, rank, 1) != rank + 1)
            throw std::runtime_error("wrong sum between the survivors");
          shutdown();
        },
        spawned());
    FAIL("the launch was expected to report rank 1");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 1);
    CHECK(reason_of(e, 1).find("killed by signal") != std::string::npos);
  }
  // Rank 0 lost: the others' shutdown still fails, naming it.
  try {
    launch_processes(
        2,
        [](int rank) {
          join_then_lose(rank, 0);
          shutdown();
        },
        spawned());
    FAIL("the launch was expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    CHECK(reason_of(e, 0).find("killed by signal") != std::string::npos);
    CHECK(reason_of(e, 1).find("rank 0") != std::string::npos);
  }
}

TEST_CASE("a rank that stops after an error tells the others why; their shutdown() fails with it") {
  try {
    launch_processes(
        2,
        [](int rank) {
          init_rpc(worker_name(rank), -1, -1, quick_options());
          if (rank == 0) {
            shutdown_after_error("bad batch 7");
            return;
          }
          shutdown();
        },
        spawned());
    FAIL("rank 1 was expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 1);
    CHECK(e.failures()[0].reason.find("bad batch 7") != std::string::npos);
  }
  // The same when the rank's function throws with its runtime running: launch_processes stops it after the error.
  try {
    launch_processes(
        2,
        [](int rank) {
          init_rpc(worker_name(rank), -1, -1, quick_options());
          if (rank == 0) throw std::runtime_error("loss is NaN");
          shutdown();
        },
        spawned());
    FAIL("both ranks were expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    CHECK(reason_of(e, 0) == "loss is NaN");
    CHECK(reason_of(e, 1).find("loss is NaN") != std::string::npos);
  }
}

TEST_CASE("under a launcher (RANK and WORLD_SIZE set) launch_processes runs this process's rank only") {
  struct SavedEnv {
    std::vector<std::pair<std::string, std::optional<std::string>>> saved;
    explicit SavedEnv(std::initializer_list<const char*> names) {
      for (const char* n : names) {
        const char* v = std::getenv(n);
        saved.emplace_back(n, v ? std::optional<std::string>(v) : std::nullopt);
      }
    }
    ~SavedEnv() {
      for (auto& [n, v] : saved) v ? ::setenv(n.c_str(), v->c_str(), 1) : ::unsetenv(n.c_str());
    }
  } restore{"RANK", "WORLD_SIZE", "CORPC_LAUNCHED"};
  ::unsetenv("CORPC_LAUNCHED");
  const bool launching_before = launching_process();
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  if (!launched_rank()) {
    CHECK(launching_before);      // the test program, started by nobody: it launches ...
    CHECK(!launching_process());  // ... until a launcher's variables say it is one of the ranks
  }
  const pid_t here = ::getpid();
  int ran = -1;
  pid_t ran_in = 0;
  launch_processes(
      2,
      [&](int rank) {
        ran = rank;
        ran_in = ::getpid();
      },
      spawned());
  if (!launched_rank()) {  // a replay returns without running anything
    CHECK(ran == 1);
    CHECK(ran_in == here);
  }
  ::setenv("WORLD_SIZE", "3", 1);
  CHECK_THROWS_WITH_AS(launch_processes(
                           2, [](int) {}, spawned()),
                       doctest::Contains("WORLD_SIZE=3"), UsageError);
}

TEST_CASE(
    "a spawned rank killed by a signal runs the program again in place, with CORPC_REJOIN, and the job succeeds") {
  killed_rank_restarts_in_place(StartMethod::spawn);
}

TEST_CASE("a rank that fails in every process is restarted max_rank_restarts times, then fails the job") {
  const std::string dir = restart_record_dir();
  LaunchOptions options = spawned();
  options.max_rank_restarts = 2;
  try {
    launch_processes(
        2,
        [dir](int rank) {
          record_process(dir, rank);
          if (rank == 1) throw std::runtime_error("rank 1 fails every time");
        },
        options);
    FAIL("rank 1 was expected to fail the job");
  } catch (const LaunchError& e) {
    if (!launched_rank()) {
      INFO(e.what());
      REQUIRE(e.failures().size() == 1);
      CHECK(e.failures()[0].rank == 1);
      CHECK(e.failures()[0].reason.find("rank 1 fails every time") != std::string::npos);
      CHECK(e.failures()[0].reason.find("after 2 restart(s)") != std::string::npos);
      CHECK(processes_of(dir, 1) == std::vector<std::string>{"- -", "1 1", "2 1"});
      CHECK(processes_of(dir, 0) == std::vector<std::string>{"- -"});
    }
  }
  if (!launched_rank()) std::filesystem::remove_all(dir);
}

TEST_CASE("rank 0 is never restarted: its failure fails the job as without restarts") {
  const std::string dir = restart_record_dir();
  LaunchOptions options = spawned();
  options.max_rank_restarts = 2;
  try {
    launch_processes(
        2,
        [dir](int rank) {
          record_process(dir, rank);
          if (rank == 0) throw std::runtime_error("rank 0 fails");
        },
        options);
    FAIL("rank 0 was expected to fail the job");
  } catch (const LaunchError& e) {
    if (!launched_rank()) {
      INFO(e.what());
      REQUIRE(e.failures().size() == 1);
      CHECK(e.failures()[0].rank == 0);
      CHECK(e.failures()[0].reason == "rank 0 fails");
      CHECK(processes_of(dir, 0) == std::vector<std::string>{"- -"});
      CHECK(processes_of(dir, 1) == std::vector<std::string>{"- -"});
    }
  }
  if (!launched_rank()) std::filesystem::remove_all(dir);
}

// Last: its ranks leave before reaching the launch, which the cases above would then never replay.
TEST_CASE("a spawned rank that exits before reaching its launch_processes call is reported, even with status 0") {
  if (launched_rank()) std::exit(0);
  try {
    launch_processes(
        2, [](int) {}, spawned());
    FAIL("the ranks were expected to fail");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 2);
    for (auto& f : e.failures()) CHECK(f.reason.find("before reaching launch_processes") != std::string::npos);
  }
}
