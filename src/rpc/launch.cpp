// Local launcher: start one process per rank (the program again, or a fork), watch them, report who failed and why.
#include "corpc/rpc/launch.hpp"

#include "transport/auth.hpp"
#include "transport/rank_identity.hpp"
#include "core/exception_text.hpp"
#include "rpc/environment.hpp"
#include "core/log.hpp"
#include "core/loopback_listener.hpp"
#include "rpc/runtime_exit.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <execinfo.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <string_view>
#include <cstring>
#include <optional>
#include <thread>

namespace corpc {

namespace {

// What a rank started by StartMethod::spawn finds in its environment: which rank it runs, which launch_processes call
// of the program runs it (counted from 1), and the pipe on which it reports.
constexpr const char* kSpawnRank = "CORPC_LAUNCH_RANK";
constexpr const char* kSpawnCall = "CORPC_LAUNCH_CALL";
constexpr const char* kReportFd = "CORPC_LAUNCH_REPORT_FD";
// How each earlier launch_processes call of the caller ended, so that a spawned rank replays them (see the header).
constexpr const char* kSpawnHistory = "CORPC_LAUNCH_HISTORY";
// The rank's variables (RANK, MASTER_PORT, ...), set only once the rank reaches its call: code before it runs as in
// the caller, and a program that branches on RANK (as under a launcher) still reaches launch_processes.
constexpr const char* kSpawnEnvironment = "CORPC_LAUNCH_ENVIRONMENT";
// Set in every rank launch_processes starts: its RANK is ours, not a launcher's (so a launch inside it starts a group).
constexpr const char* kLaunched = "CORPC_LAUNCHED";
// Set in a rank that launch_processes or corpcrun started again after it failed (see the header): whether it rejoins a
// running job, and its restart's number. Never passed on from the caller: a launch inside a rank starts a new group.
constexpr const char* kRejoin = "CORPC_REJOIN";
constexpr const char* kRankRestart = "CORPC_RANK_RESTART";
// The first byte a rank writes on its report pipe: it reached its launch_processes call. Its error text follows.
constexpr char kStarted = 'S';

struct SpawnTarget {
  int rank;
  int call;
  int report_fd;
};

std::optional<SpawnTarget> read_spawn_target() {
  const char* rank = std::getenv(kSpawnRank);
  const char* call = std::getenv(kSpawnCall);
  const char* fd = std::getenv(kReportFd);
  if (!rank || !call || !fd) return std::nullopt;
  return SpawnTarget{std::atoi(rank), std::atoi(call), std::atoi(fd)};
}

// Read before main: the variables are cleared once the rank runs, so that a launch inside it starts a new group.
const std::optional<SpawnTarget> g_spawn_target = read_spawn_target();
std::atomic<int> g_launch_calls{0};
bool g_running_spawned_rank = false;

// The pieces of `s` between `separator`s (one empty piece for an empty `s`).
std::vector<std::string_view> split(std::string_view s, char separator) {
  std::vector<std::string_view> pieces;
  for (std::size_t pos = 0;;) {
    const std::size_t end = std::min(s.find(separator, pos), s.size());
    pieces.push_back(s.substr(pos, end - pos));
    if (end == s.size()) return pieces;
    pos = end + 1;
  }
}

// The outcome of each finished launch_processes call of this process, in order, encoded for kSpawnHistory:
//   "ok" | "usage:<hex what>" | "error:<hex what>" | "failed" then ",<rank>:<hex reason>" per failed rank
// joined by ';'. Reasons are cut to 256 bytes: a replay needs the control flow, not the whole text.
std::mutex g_history_mutex;
std::vector<std::string> g_history = [] {
  std::vector<std::string> h;
  if (const char* v = std::getenv(kSpawnHistory); v && *v)
    for (std::string_view outcome : split(v, ';')) h.emplace_back(outcome);
  return h;
}();

std::string hex(std::string_view s, std::size_t limit = std::string_view::npos) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s.substr(0, limit)) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string unhex(std::string_view s) {
  auto value = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) out += static_cast<char>(value(s[i]) * 16 + value(s[i + 1]));
  return out;
}

void record_outcome(std::string outcome) {
  std::lock_guard lock(g_history_mutex);
  g_history.push_back(std::move(outcome));
}

std::string history_variable() {
  std::lock_guard lock(g_history_mutex);
  std::string v;
  for (std::size_t i = 0; i < g_history.size(); ++i) v += (i ? ";" : "") + g_history[i];
  return v;
}

// In a spawned rank, an earlier launch_processes call of the caller's: end it as it ended there.
void replay_outcome(int call);

// kSpawnEnvironment's value: "name=<hex value>" joined by ';'.
std::string encode_environment(const std::vector<std::pair<std::string, std::string>>& vars) {
  std::string out;
  for (auto& [k, v] : vars) out += (out.empty() ? "" : ";") + k + "=" + hex(v);
  return out;
}

void apply_environment(std::string_view encoded) {
  for (std::string_view item : split(encoded, ';')) {
    const std::size_t eq = item.find('=');
    if (eq != std::string_view::npos)
      ::setenv(std::string(item.substr(0, eq)).c_str(), unhex(item.substr(eq + 1)).c_str(), 1);
  }
}

std::string describe(const std::vector<RankFailure>& failures) {
  std::string s = "launch_processes: " + std::to_string(failures.size()) + " rank(s) failed";
  for (auto& f : failures) s += "\n  rank " + std::to_string(f.rank) + ": " + f.reason;
  return s;
}

// A listening socket on 127.0.0.1 with a port the OS chose; inherited by rank 0 (forked: close-on-exec).
int bind_master_socket(int& port) {
  const int fd = detail::listen_on_loopback(port, /*keep_across_exec=*/false);
  if (fd < 0) throw RpcError(std::string("launch_processes: cannot bind a port: ") + std::strerror(errno));
  return fd;
}

// A crashing rank prints where, so that the report says more than "signal 11".
void print_backtrace_and_die(int sig) {
  void* frames[64];
  int n = ::backtrace(frames, 64);
  char head[96];
  int len = std::snprintf(head, sizeof head, "[rank %s] fatal signal %d; backtrace:\n", std::getenv("RANK"), sig);
  auto w = ::write(STDERR_FILENO, head, static_cast<std::size_t>(len));
  (void)w;
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

// Runs one rank's function; a runtime it left running is shut down for it. Returns why the rank failed ("" if not).
std::string run_rank(int rank, const std::function<void(int)>& fn) {
  std::string error;
  try {
    fn(rank);
  } catch (...) {
    error = detail::exception_text(std::current_exception());
  }
  try {
    std::string left = detail::close_runtime_left_open(error);
    if (error.empty()) error = std::move(left);
  } catch (...) {
    if (error.empty()) error = detail::exception_text(std::current_exception());
  }
  return error;
}

// The end of a rank's process, in both start methods: runs `fn`, reports on `report_fd`, leaves without the exit
// handlers and static destructors of state that belongs to the caller (fork) or to a main that never finished (spawn).
[[noreturn]] void run_rank_and_exit(int rank, int report_fd, const std::function<void(int)>& fn) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, print_backtrace_and_die);
  auto n = ::write(report_fd, &kStarted, 1);
  std::string error = run_rank(rank, fn);
#if defined(__SANITIZE_ADDRESS__)
  // Ranks leave through _exit, which skips LeakSanitizer's exit-time check: run it here, once the rank is done.
  // CORPC_RANK_LEAK_CHECK=0 skips it: in a forked rank the check writes to every heap chunk the parent allocated
  // (libtorch's registries), copying the whole inherited heap page by page, seconds per rank.
  const char* check = std::getenv("CORPC_RANK_LEAK_CHECK");
  bool check_leaks = !check || std::string_view(check) != "0";
  if (error.empty() && check_leaks && __lsan_do_recoverable_leak_check() != 0)
    error = "LeakSanitizer found leaks (report above)";
#endif
  if (!error.empty()) {
    detail::log(detail::LogLevel::error, "rank " + std::to_string(rank), "launch_processes", "failed: {}", error);
    n = ::write(report_fd, error.data(), error.size());
  }
  (void)n;
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(error.empty() ? 0 : 1);
}

// Which of this launch's processes a rank is, proven (src/transport/rank_identity.hpp): rank 0 gets the launch's key,
// every start of every rank the credential for its rank and restart. Never passed on from the caller.
constexpr const char* kRankKey = "CORPC_RANK_KEY";
constexpr const char* kRankCredential = "CORPC_RANK_CREDENTIAL";

// The variables every rank gets, as torchrun sets them, plus corpc's own; `restart` counts the rank's restarts.
std::vector<std::pair<std::string, std::string>> rank_environment(int rank, int world_size, int port,
                                                                  const std::string& secret, int restart,
                                                                  const std::string& launcher_key) {
  std::vector<std::pair<std::string, std::string>> vars{
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
      {"CORPC_SECRET", secret},  // connections between this run's ranks authenticate with it
      {kLaunched, "1"},
      {kRankCredential, detail::rank_credential(launcher_key, rank, static_cast<std::uint32_t>(restart))}};
  if (rank == 0) vars.emplace_back(kRankKey, launcher_key);
  if (restart > 0) {
    vars.emplace_back(kRejoin, "1");
    vars.emplace_back(kRankRestart, std::to_string(restart));
  }
  return vars;
}

// `listen_fd` is rank 0's socket, or -1 once the launcher has closed it (a restart, never of rank 0).
[[noreturn]] void run_forked_child(int rank, int world_size, int port, int listen_fd, int report_fd,
                                   const std::string& secret, int restart, const std::string& launcher_key,
                                   const std::function<void(int)>& fn) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (const char* v : {kRejoin, kRankRestart, kRankKey}) ::unsetenv(v);
  for (auto& [k, v] : rank_environment(rank, world_size, port, secret, restart, launcher_key))
    ::setenv(k.c_str(), v.c_str(), 1);
  if (rank == 0) {
    ::setenv("CORPC_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
  } else {
    if (listen_fd >= 0) ::close(listen_fd);
    ::unsetenv("CORPC_LISTEN_FD");
  }
  run_rank_and_exit(rank, report_fd, fn);
}

// This program's path and arguments, as it was started: what a spawned rank runs.
struct Program {
  std::string path;
  std::vector<std::string> args;
};

Program this_program() {
  Program p;
  std::array<char, 4096> buf{};
  const auto n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0)
    throw RpcError(std::string("launch_processes: cannot find this program (/proc/self/exe): ") + std::strerror(errno));
  p.path.assign(buf.data(), static_cast<std::size_t>(n));
  std::ifstream cmdline("/proc/self/cmdline", std::ios::binary);
  std::string arg;
  while (std::getline(cmdline, arg, '\0')) p.args.push_back(arg);
  if (p.args.empty()) p.args.push_back(p.path);
  return p;
}

// Everything execve needs, made before fork: between fork and exec the child may only make async-signal-safe calls.
struct ExecImage {
  std::vector<std::string> strings;  // owns what the pointer arrays point into
  std::vector<char*> argv, envp;
};

// `vars` are set; the caller's values of the `hidden` names are not passed on.
ExecImage exec_image(const Program& program, const std::vector<std::pair<std::string, std::string>>& vars,
                     const std::set<std::string>& hidden) {
  ExecImage image;
  image.strings.reserve(program.args.size() + vars.size() + 256);
  for (auto& a : program.args) image.strings.push_back(a);
  const std::size_t argc = image.strings.size();
  std::set<std::string> ours = hidden;
  for (auto& [k, v] : vars) ours.insert(k);
  for (char** e = environ; *e; ++e) {
    std::string_view entry(*e);
    if (!ours.count(std::string(entry.substr(0, entry.find('='))))) image.strings.emplace_back(entry);
  }
  for (auto& [k, v] : vars) image.strings.push_back(k + "=" + v);
  for (std::size_t i = 0; i < image.strings.size(); ++i)
    (i < argc ? image.argv : image.envp).push_back(image.strings[i].data());
  image.argv.push_back(nullptr);
  image.envp.push_back(nullptr);
  return image;
}

pid_t spawn_child(const std::string& path, const ExecImage& image, int report_fd, int inherited_fd) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);
  ::fcntl(report_fd, F_SETFD, 0);
  if (inherited_fd >= 0) ::fcntl(inherited_fd, F_SETFD, 0);
  ::execve(path.c_str(), image.argv.data(), image.envp.data());
  static const char msg[] = "launch_processes: cannot run this program again (execve failed)";
  auto n = ::write(report_fd, msg, sizeof msg - 1);
  (void)n;
  ::_exit(127);
}

int threads_in_this_process() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

// Threads that shared libraries start as they load (OpenBLAS's pool, which re-creates itself in a forked child) are
// there before any code of the program runs: fork's check counts only the threads started after them.
const int g_threads_at_start = threads_in_this_process();

// The threads this process started since it loaded that a fork would leave behind locked (corpc's logger is not one).
int threads_fork_would_strand() {
#if defined(__SANITIZE_THREAD__)
  return 0;  // ThreadSanitizer starts a thread of its own at the first pthread_create, and reports such a fork itself
#else
  return threads_in_this_process() - g_threads_at_start - detail::fork_safe_threads();
#endif
}

// Under a launcher that set RANK and WORLD_SIZE (not launch_processes itself): this process's rank.
std::optional<int> launcher_rank(int world_size) {
  const char* rank = std::getenv("RANK");
  const char* size = std::getenv("WORLD_SIZE");
  if (!rank || !*rank || !size || !*size || std::getenv(kLaunched)) return std::nullopt;
  const int r = std::atoi(rank), n = std::atoi(size);
  if (n != world_size)
    throw UsageError("launch_processes(" + std::to_string(world_size) + "): this process runs under a launcher that " +
                     "started WORLD_SIZE=" + std::to_string(n) + " ranks; start it with " + std::to_string(world_size) +
                     " (or without a launcher)");
  if (r < 0 || r >= n)
    throw UsageError("launch_processes: RANK=" + std::string(rank) + " is not below WORLD_SIZE=" + size);
  return r;
}

std::string started_late(const std::string& text) {
  return "before reaching launch_processes (spawn runs the program again in each rank, which must reach the same "
         "launch_processes call)" +
         (text.empty() ? std::string() : ": " + text);
}

}  // namespace

LaunchError::LaunchError(std::vector<RankFailure> failures)
    : RpcError(describe(failures)), failures_(std::move(failures)) {}

namespace {

void replay_outcome(int call) {
  std::string outcome;
  {
    std::lock_guard lock(g_history_mutex);
    if (call - 1 < static_cast<int>(g_history.size())) outcome = g_history[call - 1];
  }
  if (outcome.empty() || outcome == "ok") return;
  if (outcome.rfind("usage:", 0) == 0) throw UsageError(unhex(outcome.substr(6)));
  if (outcome.rfind("error:", 0) == 0) throw RpcError(unhex(outcome.substr(6)));
  std::vector<RankFailure> failures;
  const auto items = split(outcome, ',');  // "failed", then "<rank>:<hex reason>" each
  for (std::size_t i = 1; i < items.size(); ++i) {
    const std::size_t colon = items[i].find(':');
    failures.push_back({std::atoi(std::string(items[i].substr(0, colon)).c_str()), unhex(items[i].substr(colon + 1))});
  }
  throw LaunchError(std::move(failures));
}

// Starts and watches the ranks of one launch (the caller's side).
void launch_group(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options);

}  // namespace

std::optional<int> launched_rank() {
  if (!g_spawn_target) return std::nullopt;
  return g_spawn_target->rank;
}

bool launching_process() {
  if (g_spawn_target || std::getenv(kLaunched)) return false;  // a rank launch_processes started
  return detail::rank_from_environment() < 0 || detail::world_size_from_environment() < 0;  // else a launcher's rank
}

int rank_restart_count() {
  const char* v = std::getenv(kRankRestart);
  return v ? std::max(0, std::atoi(v)) : 0;
}

bool rejoining() {
  const char* v = std::getenv(kRejoin);
  return v && std::string_view(v) == "1";
}

void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options) {
  const int call = ++g_launch_calls;
  if (g_spawn_target && call <= g_spawn_target->call && !g_running_spawned_rank) {
    if (call < g_spawn_target->call) return replay_outcome(call);  // it ran in the caller
    const SpawnTarget target = *g_spawn_target;
    if (const char* vars = std::getenv(kSpawnEnvironment)) apply_environment(vars);
    for (const char* v : {kSpawnRank, kSpawnCall, kReportFd, kSpawnHistory, kSpawnEnvironment}) ::unsetenv(v);
    ::fcntl(target.report_fd, F_SETFD, FD_CLOEXEC);
    g_running_spawned_rank = true;
    run_rank_and_exit(target.rank, target.report_fd, fn);
  }
  // Every outcome is recorded, a launcher's rank's too: a spawned rank replays them by their order.
  try {
    if (auto rank = launcher_rank(world_size)) {
      std::string error = run_rank(*rank, fn);
      if (!error.empty()) throw RpcError("rank " + std::to_string(*rank) + ": " + error);
    } else {
      launch_group(world_size, call, fn, options);
    }
    record_outcome("ok");
  } catch (const LaunchError& e) {
    std::string outcome = "failed";
    for (auto& f : e.failures()) outcome += "," + std::to_string(f.rank) + ":" + hex(f.reason, 256);
    record_outcome(std::move(outcome));
    throw;
  } catch (const UsageError& e) {
    record_outcome("usage:" + hex(e.what(), 256));
    throw;
  } catch (const std::exception& e) {
    record_outcome("error:" + hex(e.what(), 256));
    throw;
  }
}

namespace {

void launch_group(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options) {
  if (world_size <= 0) throw UsageError("launch_processes: world_size must be positive");
  if (options.max_rank_restarts < 0) throw UsageError("launch_processes: max_rank_restarts must not be negative");
  if (options.start == StartMethod::spawn && g_running_spawned_rank)
    throw UsageError(
        "launch_processes: a rank that StartMethod::spawn started cannot spawn ranks of its own (they "
        "would run the program from its start); use StartMethod::fork there");
  if (options.start == StartMethod::fork) {
    if (const int started = threads_fork_would_strand(); started > 0)
      throw UsageError("launch_processes: StartMethod::fork refused: this process has started " +
                       std::to_string(started) +
                       " thread(s) (libtorch's intra-op pool after a parallel operation, its "
                       "autograd workers after a backward, an RPC runtime), and a forked rank would hang in them. Use "
                       "StartMethod::spawn (the default), or launch before anything starts threads");
  }
  int port = 0;
  const int listen_fd = bind_master_socket(port);
  struct Child {
    pid_t pid = -1;
    int report_fd = -1;
    std::string report;  // kStarted, then the error text
    bool done = false;
    int restarts = 0;  // how many times this rank was started again after failing
  };
  std::vector<Child> children(world_size);
  // The caller's CORPC_SECRET if it set one (ranks launched elsewhere may join), else a fresh one for this run.
  const std::string secret = [] {
    std::string s = detail::secret_from_environment();
    return s.empty() ? detail::random_secret() : s;
  }();
  // This launch's own key, whatever the secret: ranks of another launch (or an earlier run) cannot pass for ours.
  const std::string launcher_key = detail::random_launcher_key();
  const bool spawn = options.start == StartMethod::spawn;
  const Program program = spawn ? this_program() : Program{};
  // Starts `rank`'s process (its `restart`th restart; 0: its first start); the rank's listening socket is open only
  // for rank 0's first start.
  int open_listen_fd = listen_fd;
  auto start_rank = [&](int rank, int restart) {
    std::fflush(stdout);
    std::fflush(stderr);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw RpcError("launch_processes: pipe failed");
    pid_t pid;
    if (spawn) {
      auto rank_vars = rank_environment(rank, world_size, port, secret, restart, launcher_key);
      if (rank == 0) rank_vars.emplace_back("CORPC_LISTEN_FD", std::to_string(open_listen_fd));
      std::set<std::string> hidden{"CORPC_LISTEN_FD", kRejoin, kRankRestart, kRankKey};
      for (auto& [k, v] : rank_vars) hidden.insert(k);
      const std::vector<std::pair<std::string, std::string>> vars{{kSpawnRank, std::to_string(rank)},
                                                                  {kSpawnCall, std::to_string(call)},
                                                                  {kReportFd, std::to_string(p[1])},
                                                                  {kSpawnHistory, history_variable()},
                                                                  {kSpawnEnvironment, encode_environment(rank_vars)}};
      const ExecImage image = exec_image(program, vars, hidden);
      pid = spawn_child(program.path, image, p[1], rank == 0 ? open_listen_fd : -1);
    } else {
      pid = ::fork();
      if (pid == 0) {
        ::close(p[0]);
        run_forked_child(rank, world_size, port, open_listen_fd, p[1], secret, restart, launcher_key, fn);
      }
    }
    if (pid < 0) {
      const int error = errno;
      ::close(p[0]);
      ::close(p[1]);
      throw RpcError(std::string("launch_processes: fork failed: ") + std::strerror(error));
    }
    ::close(p[1]);
    ::fcntl(p[0], F_SETFL, O_NONBLOCK);
    children[rank] = Child{pid, p[0], {}, false, restart};
  };
  for (int rank = 0; rank < world_size; ++rank) start_rank(rank, 0);
  ::close(listen_fd);
  open_listen_fd = -1;

  std::vector<RankFailure> failures;
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  int running = world_size;
  auto drain = [](Child& c) {
    char buf[4096];
    for (;;) {
      auto n = ::read(c.report_fd, buf, sizeof buf);
      if (n <= 0) break;
      c.report.append(buf, static_cast<std::size_t>(n));
    }
  };
  auto reason_of = [&](const Child& c, int status) -> std::string {
    const bool started = !c.report.empty() && c.report[0] == kStarted;
    const std::string text = started ? c.report.substr(1) : c.report;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return started ? "" : "exited (code 0) " + started_late(text);
    if (WIFEXITED(status)) {
      const std::string code = "exited with code " + std::to_string(WEXITSTATUS(status));
      if (!started) return code + " " + started_late(text);
      return text.empty() ? code : text;
    }
    std::string r = std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
    if (!started) return r + " " + started_late(text);
    return r + (text.empty() ? "" : " after: " + text);
  };
  while (running > 0) {
    for (int rank = 0; rank < world_size; ++rank) {
      auto& c = children[rank];
      if (c.done) continue;
      drain(c);
      int status = 0;
      pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r != c.pid) continue;
      drain(c);
      std::string reason = reason_of(c, status);
      // In place, while the job has not started failing: the others go on and the new process rejoins them.
      if (!reason.empty() && rank != 0 && c.restarts < options.max_rank_restarts && !kill_at) {
        const int restart = c.restarts + 1;
        detail::log(detail::LogLevel::warn, "rank " + std::to_string(rank), "launch_processes",
                    "failed: {}; restarting it in place (restart {} of {})", reason, restart,
                    options.max_rank_restarts);
        ::close(c.report_fd);
        c.report_fd = -1;
        try {
          start_rank(rank, restart);
          continue;
        } catch (const std::exception& e) {
          reason += std::string("; restarting it failed: ") + e.what();
        }
      }
      c.done = true;
      --running;
      if (!reason.empty()) {
        if (c.restarts > 0) reason += " (after " + std::to_string(c.restarts) + " restart(s))";
        failures.push_back({rank, reason});
        if (!kill_at) kill_at = std::chrono::steady_clock::now() + options.grace;
      }
    }
    if (running == 0) break;
    auto now = std::chrono::steady_clock::now();
    bool timed_out = now - start > options.timeout;
    if (timed_out || (kill_at && now > *kill_at)) {
      for (int rank = 0; rank < world_size; ++rank) {
        auto& c = children[rank];
        if (c.done) continue;
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
        drain(c);
        c.done = true;
        --running;
        failures.push_back({rank, timed_out ? "timed out after " + std::to_string(options.timeout.count()) + " ms"
                                            : "killed after another rank failed"});
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (auto& c : children)
    if (c.report_fd >= 0) ::close(c.report_fd);
  if (!failures.empty()) throw LaunchError(std::move(failures));
}

}  // namespace

}  // namespace corpc
