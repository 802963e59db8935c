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
#include "transport/launcher_key.hpp"
#include "rpc/rank_process.hpp"
#include "transport/auth.hpp"

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

}  // namespace

void launch_group(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options,
                  bool inside_spawned_rank) {
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
    std::string s = secret_from_environment();
    return s.empty() ? random_secret() : s;
  }();
  // This launch's own key, whatever the secret: ranks of another launch (or an earlier run) cannot pass for ours.
  const LauncherKey launcher_key;
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
    // Made just before the fork that needs it, wiped here just after: the ranks forked later do not inherit it.
    const RankSecrets secrets(launcher_key, rank, static_cast<std::uint32_t>(restart));
    if (spawn) {
      auto rank_vars = rank_environment(rank, world_size, port, secret, restart, secrets);
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
        run_forked_child(rank, world_size, port, open_listen_fd, p[1], secret, restart, secrets, fn);
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
        detail::log(LogLevel::warn, "rank " + std::to_string(rank), "launch_processes",
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

}  // namespace corpc::detail
