// Starting, restarting and watching the ranks of one launch, on the caller's side.
#include "rpc/launch_supervisor.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/log.hpp"
#include "core/loopback_listener.hpp"
#include "rpc/environment.hpp"
#include "rpc/fork_safety.hpp"
#include "rpc/launch_protocol.hpp"
#include "rpc/rank_process.hpp"
#include "transport/auth.hpp"
#include "transport/launcher_key.hpp"

namespace corpc::detail {
namespace {

// A listening socket on 127.0.0.1 with a port the OS chose; inherited by rank 0 (forked: close-on-exec).
int bind_master_socket(int& port) {
  const int fd = listen_on_loopback(port, /*keep_across_exec=*/false);
  if (fd < 0) throw RpcError(std::string("launch_processes: cannot bind a port: ") + std::strerror(errno));
  return fd;
}

std::string started_late(const std::string& text) {
  return "before reaching launch_processes (spawn runs the program again in each rank, which must reach the same "
         "launch_processes call)" +
         (text.empty() ? std::string() : ": " + text);
}

// What a rank's exit says, from its exit status and what it wrote on its report pipe ("" for a rank that reached its
// launch_processes call and returned).
std::string reason_of(const std::string& report, int status) {
  const bool started = !report.empty() && report[0] == kStarted;
  const std::string text = started ? report.substr(1) : report;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return started ? "" : "exited (code 0) " + started_late(text);
  if (WIFEXITED(status)) {
    const std::string code = "exited with code " + std::to_string(WEXITSTATUS(status));
    if (!started) return code + " " + started_late(text);
    return text.empty() ? code : text;
  }
  std::string r = std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
  if (!started) return r + " " + started_late(text);
  return r + (text.empty() ? "" : " after: " + text);
}

void check_launch_options(int world_size, const LaunchOptions& options, bool inside_spawned_rank) {
  if (world_size <= 0) throw UsageError("launch_processes: world_size must be positive");
  if (options.max_rank_restarts < 0) throw UsageError("launch_processes: max_rank_restarts must not be negative");
  if (options.start == StartMethod::spawn && inside_spawned_rank)
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
}

// One launch's ranks, from their first start to the last one's exit: starts each (forked or spawned), restarts a
// failed one in place while the job has not started failing, and once a rank has failed (or the launch timed out)
// kills the rest after the grace period. Everything here runs on the caller's thread.
class LaunchGroup {
 public:
  LaunchGroup(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options)
      : world_size_(world_size), call_(call), fn_(fn), options_(options), children_(world_size) {
    listen_fd_ = bind_master_socket(port_);
  }
  // Ranks still running here were started before a later start failed: they would wait for peers that never come.
  ~LaunchGroup() {
    if (listen_fd_ >= 0) ::close(listen_fd_);
    for (auto& c : children_) {
      if (c.pid > 0 && !c.done) {
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
      }
      if (c.report_fd >= 0) ::close(c.report_fd);
    }
  }
  LaunchGroup(const LaunchGroup&) = delete;
  LaunchGroup& operator=(const LaunchGroup&) = delete;

  // Starts every rank; rank 0 inherits the listening socket, which this process then closes.
  void start_all() {
    for (int rank = 0; rank < world_size_; ++rank) start_rank(rank, 0);
    ::close(listen_fd_);
    listen_fd_ = -1;
  }

  // Polls the ranks until every one has exited or been killed; returns the failures, in the order they were seen.
  std::vector<RankFailure> watch() {
    const auto start = std::chrono::steady_clock::now();
    while (running_ > 0) {
      for (int rank = 0; rank < world_size_; ++rank) reap(rank);
      if (running_ == 0) break;
      const auto now = std::chrono::steady_clock::now();
      const bool timed_out = now - start > options_.timeout;
      if (timed_out || (kill_at_ && now > *kill_at_)) {
        kill_remaining(timed_out ? "timed out after " + std::to_string(options_.timeout.count()) + " ms"
                                 : "killed after another rank failed");
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return std::move(failures_);
  }

 private:
  struct Child {
    pid_t pid = -1;
    int report_fd = -1;
    std::string report;  // kStarted, then the error text
    bool done = false;
    int restarts = 0;  // how many times this rank was started again after failing
  };

  // Starts `rank`'s process (its `restart`th restart; 0: its first start); the listening socket is open only for
  // rank 0's first start.
  void start_rank(int rank, int restart) {
    std::fflush(stdout);
    std::fflush(stderr);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw RpcError("launch_processes: pipe failed");
    // Made just before the fork that needs it, wiped here just after: the ranks forked later do not inherit it.
    const RankSecrets secrets(launcher_key_, rank, static_cast<std::uint32_t>(restart));
    const pid_t pid = spawn_ ? spawn_rank(rank, restart, secrets, p[1]) : fork_rank(rank, restart, secrets, p);
    if (pid < 0) {
      const int error = errno;
      ::close(p[0]);
      ::close(p[1]);
      throw RpcError(std::string("launch_processes: fork failed: ") + std::strerror(error));
    }
    ::close(p[1]);
    ::fcntl(p[0], F_SETFL, O_NONBLOCK);
    children_[rank] = Child{pid, p[0], {}, false, restart};
  }

  // The program run again, its rank's variables set once it reaches this launch_processes call (launch_protocol.hpp).
  pid_t spawn_rank(int rank, int restart, const RankSecrets& secrets, int report_fd) {
    auto rank_vars = rank_environment(rank, world_size_, port_, secret_, restart, secrets);
    if (rank == 0) rank_vars.emplace_back("CORPC_LISTEN_FD", std::to_string(listen_fd_));
    std::set<std::string> hidden{"CORPC_LISTEN_FD", kRejoin, kRankRestart, kRankKey};
    for (auto& [k, v] : rank_vars) hidden.insert(k);
    const std::vector<std::pair<std::string, std::string>> vars{{kSpawnRank, std::to_string(rank)},
                                                                {kSpawnCall, std::to_string(call_)},
                                                                {kReportFd, std::to_string(report_fd)},
                                                                {kSpawnHistory, history_variable()},
                                                                {kSpawnEnvironment, encode_environment(rank_vars)}};
    const ExecImage image = exec_image(program_, vars, hidden);
    return spawn_child(program_.path, image, report_fd, rank == 0 ? listen_fd_ : -1);
  }

  pid_t fork_rank(int rank, int restart, const RankSecrets& secrets, const int (&pipe)[2]) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(pipe[0]);
      run_forked_child(rank, world_size_, port_, listen_fd_, pipe[1], secret_, restart, secrets, fn_);
    }
    return pid;
  }

  static void drain(Child& c) {
    char buf[4096];
    for (;;) {
      auto n = ::read(c.report_fd, buf, sizeof buf);
      if (n <= 0) break;
      c.report.append(buf, static_cast<std::size_t>(n));
    }
  }

  // Collects `rank`'s exit if it has exited: restarts it in place, or records how it ended.
  void reap(int rank) {
    auto& c = children_[rank];
    if (c.done) return;
    drain(c);
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) != c.pid) return;
    drain(c);
    std::string reason = reason_of(c.report, status);
    // In place, while the job has not started failing: the others go on and the new process rejoins them.
    if (!reason.empty() && rank != 0 && c.restarts < options_.max_rank_restarts && !kill_at_) {
      const int restart = c.restarts + 1;
      detail::log(LogLevel::warn, "rank " + std::to_string(rank), "launch_processes",
                  "failed: {}; restarting it in place (restart {} of {})", reason, restart, options_.max_rank_restarts);
      ::close(c.report_fd);
      c.report_fd = -1;
      try {
        start_rank(rank, restart);
        return;
      } catch (const std::exception& e) {
        reason += std::string("; restarting it failed: ") + e.what();
      }
    }
    c.done = true;
    --running_;
    if (reason.empty()) return;
    if (c.restarts > 0) reason += " (after " + std::to_string(c.restarts) + " restart(s))";
    failures_.push_back({rank, reason});
    if (!kill_at_) kill_at_ = std::chrono::steady_clock::now() + options_.grace;
  }

  void kill_remaining(const std::string& reason) {
    for (int rank = 0; rank < world_size_; ++rank) {
      auto& c = children_[rank];
      if (c.done) continue;
      ::kill(c.pid, SIGKILL);
      ::waitpid(c.pid, nullptr, 0);
      drain(c);
      c.done = true;
      --running_;
      failures_.push_back({rank, reason});
    }
  }

  const int world_size_, call_;
  const std::function<void(int rank)>& fn_;
  const LaunchOptions& options_;
  // The caller's CORPC_SECRET if it set one (ranks launched elsewhere may join), else a fresh one for this run.
  const std::string secret_ = [] {
    std::string s = secret_from_environment();
    return s.empty() ? random_secret() : s;
  }();
  // This launch's own key, whatever the secret: ranks of another launch (or an earlier run) cannot pass for ours.
  const LauncherKey launcher_key_;
  const bool spawn_ = options_.start == StartMethod::spawn;
  const Program program_ = spawn_ ? this_program() : Program{};
  int port_ = 0;
  int listen_fd_ = -1;
  std::vector<Child> children_;
  int running_ = world_size_;
  std::vector<RankFailure> failures_;
  std::optional<std::chrono::steady_clock::time_point> kill_at_;  // when the ranks still running are killed
};

}  // namespace

void launch_group(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options,
                  bool inside_spawned_rank) {
  check_launch_options(world_size, options, inside_spawned_rank);
  LaunchGroup group(world_size, call, fn, options);
  group.start_all();
  std::vector<RankFailure> failures = group.watch();
  if (!failures.empty()) throw LaunchError(std::move(failures));
}

}  // namespace corpc::detail
