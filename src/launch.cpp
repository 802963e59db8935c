// Local launcher: fork one process per rank, watch them, report who failed and why.
#include "corpc/rpc/launch.hpp"

#include "auth.hpp"
#include "log.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <execinfo.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

namespace corpc {

namespace {

std::string describe(const std::vector<RankFailure>& failures) {
  std::string s = "launch_processes: " + std::to_string(failures.size()) + " rank(s) failed";
  for (auto& f : failures) s += "\n  rank " + std::to_string(f.rank) + ": " + f.reason;
  return s;
}

// A listening socket on 127.0.0.1 with a port the OS chose; inherited by rank 0.
int bind_master_socket(int& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw RpcError(std::string("launch_processes: socket: ") + std::strerror(errno));
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(fd);
    throw RpcError(std::string("launch_processes: cannot bind a port: ") + std::strerror(errno));
  }
  port = ntohs(addr.sin_port);
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

[[noreturn]] void run_child(int rank, int world_size, int port, int listen_fd, int err_fd, const std::string& secret,
                            const std::function<void(int)>& fn) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, print_backtrace_and_die);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
  ::setenv("CORPC_SECRET", secret.c_str(), 1);  // connections between this run's ranks authenticate with it
  if (rank == 0) {
    ::setenv("CORPC_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
  } else {
    ::close(listen_fd);
    ::unsetenv("CORPC_LISTEN_FD");
  }
  int code = 0;
  std::string error;
  try {
    fn(rank);
  } catch (const std::exception& e) {
    error = e.what();
    code = 1;
  } catch (...) {
    error = "unknown exception";
    code = 1;
  }
#if defined(__SANITIZE_ADDRESS__)
  // Ranks leave through _exit, which skips LeakSanitizer's exit-time check: run it here, once the rank is done.
  if (code == 0 && __lsan_do_recoverable_leak_check() != 0) {
    error = "LeakSanitizer found leaks (report above)";
    code = 1;
  }
#endif
  if (!error.empty()) {
    detail::log(detail::LogLevel::error, "rank " + std::to_string(rank), "launch_processes", "failed: {}", error);
    auto n = ::write(err_fd, error.data(), error.size());
    (void)n;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(code);  // no atexit handlers or static destructors of the parent's state
}

}  // namespace

LaunchError::LaunchError(std::vector<RankFailure> failures) : RpcError(describe(failures)), failures_(std::move(failures)) {}

void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options) {
  if (world_size <= 0) throw UsageError("launch_processes: world_size must be positive");
  int port = 0;
  const int listen_fd = bind_master_socket(port);
  struct Child {
    pid_t pid = -1;
    int err_fd = -1;
    std::string error;
    bool done = false;
  };
  std::vector<Child> children(world_size);
  // The caller's CORPC_SECRET if it set one (ranks launched elsewhere may join), else a fresh one for this run.
  const std::string secret = [] {
    std::string s = detail::secret_from_environment();
    return s.empty() ? detail::random_secret() : s;
  }();
  std::fflush(stdout);
  std::fflush(stderr);
  for (int rank = 0; rank < world_size; ++rank) {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw RpcError("launch_processes: pipe failed");
    pid_t pid = ::fork();
    if (pid < 0) throw RpcError(std::string("launch_processes: fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      ::close(p[0]);
      run_child(rank, world_size, port, listen_fd, p[1], secret, fn);
    }
    ::close(p[1]);
    ::fcntl(p[0], F_SETFL, O_NONBLOCK);
    children[rank] = Child{pid, p[0], {}, false};
  }
  ::close(listen_fd);

  std::vector<RankFailure> failures;
  const auto start = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  int running = world_size;
  auto drain = [](Child& c) {
    char buf[4096];
    for (;;) {
      auto n = ::read(c.err_fd, buf, sizeof buf);
      if (n <= 0) break;
      c.error.append(buf, static_cast<std::size_t>(n));
    }
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
      c.done = true;
      --running;
      std::string reason;
      if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
        reason = c.error.empty() ? "exited with code " + std::to_string(WEXITSTATUS(status)) : c.error;
      else if (WIFSIGNALED(status))
        reason = std::string("killed by signal ") + ::strsignal(WTERMSIG(status)) +
                 (c.error.empty() ? "" : " after: " + c.error);
      if (!reason.empty()) {
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
  for (auto& c : children) ::close(c.err_fd);
  if (!failures.empty()) throw LaunchError(std::move(failures));
}

}  // namespace corpc
