// corpcrun — start N ranks of any corpc program on this host, as `torchrun --standalone --nproc_per_node N
// --no_python` does for a binary:
//
//   corpcrun -n 4 ./train --epochs 3
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a port the OS
// chose, held open for rank 0 as CORPC_LISTEN_FD so that concurrent runs never collide) and one CORPC_SECRET for the
// run (the caller's if set). Output lines are prefixed with "[rank N] ". SIGINT, SIGTERM and SIGHUP are forwarded to
// every rank. When a rank fails the others get a grace period, then are killed; the exit status is non-zero and the
// last line names each failed rank and why. Torch-free on purpose: it links nothing of corpc.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: corpcrun [-n N] [--grace SECONDS] [--timeout SECONDS] [--] PROGRAM [ARGS...]\n"
               "  -n, --nproc N     ranks to start on this host (default 2)\n"
               "  --grace S         after a rank fails, seconds before the others are killed (default 10)\n"
               "  --timeout S       kill every rank after S seconds (default: none)\n");
  std::exit(code);
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "corpcrun: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(2);
}

int bind_master_socket(int& port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);  // inherited by rank 0 across exec: no SOCK_CLOEXEC
  if (fd < 0) die("socket");
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, 128) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    die("cannot bind a port on 127.0.0.1");
  port = ntohs(addr.sin_port);
  return fd;
}

std::string fresh_secret() {
  unsigned char bytes[32];
  if (::getrandom(bytes, sizeof bytes, 0) != static_cast<ssize_t>(sizeof bytes)) die("getrandom");
  std::string hex;
  for (unsigned char b : bytes) {
    char h[3];
    std::snprintf(h, sizeof h, "%02x", b);
    hex += h;
  }
  return hex;
}

// One of a rank's output streams: bytes are passed on a line at a time, each line prefixed with the rank.
struct Stream {
  int fd = -1;
  FILE* to = nullptr;
  std::string partial;

  void flush_lines(const std::string& prefix, bool eof) {
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1)
      std::fprintf(to, "%s%.*s\n", prefix.c_str(), static_cast<int>(nl - start), partial.data() + start);
    partial.erase(0, start);
    if (eof && !partial.empty()) {
      std::fprintf(to, "%s%s\n", prefix.c_str(), partial.c_str());
      partial.clear();
    }
    std::fflush(to);
  }
};

struct Rank {
  pid_t pid = -1;
  Stream out, err;
  bool done = false;
  std::string failure;  // empty: exited 0
};

}  // namespace

int main(int argc, char** argv) {
  int nproc = 2;
  double grace_s = 10, timeout_s = 0;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(2);
      return argv[++i];
    };
    if (a == "-n" || a == "--nproc" || a == "--nproc_per_node") nproc = std::atoi(value());
    else if (a == "--grace") grace_s = std::atof(value());
    else if (a == "--timeout") timeout_s = std::atof(value());
    else if (a == "-h" || a == "--help") usage(0);
    else if (a == "--") {
      ++i;
      break;
    } else if (a[0] == '-') usage(2);
    else break;
  }
  if (i >= argc || nproc <= 0) usage(2);
  char** command = argv + i;

  int port = 0;
  const int listen_fd = bind_master_socket(port);
  const char* caller_secret = std::getenv("CORPC_SECRET");
  const std::string secret = caller_secret && *caller_secret ? caller_secret : fresh_secret();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<Rank> ranks(nproc);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < nproc; ++r) {
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) die("pipe");
    pid_t pid = ::fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // ranks never outlive the launcher
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
      auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(r));
      set("LOCAL_RANK", std::to_string(r));
      set("WORLD_SIZE", std::to_string(nproc));
      set("LOCAL_WORLD_SIZE", std::to_string(nproc));
      set("MASTER_ADDR", "127.0.0.1");
      set("MASTER_PORT", std::to_string(port));
      set("CORPC_SECRET", secret);
      if (r == 0) {
        set("CORPC_LISTEN_FD", std::to_string(listen_fd));
      } else {
        ::close(listen_fd);
        ::unsetenv("CORPC_LISTEN_FD");
      }
      ::execvp(command[0], command);
      std::fprintf(stderr, "corpcrun: cannot run %s: %s\n", command[0], std::strerror(errno));
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    ranks[r].pid = pid;
    ranks[r].out = Stream{out[0], stdout, {}};
    ranks[r].err = Stream{err[0], stderr, {}};
  }
  ::close(listen_fd);

  const auto start = Clock::now();
  std::optional<Clock::time_point> kill_at;
  std::string kill_reason;
  int running = nproc, forwarded = 0;
  auto kill_rest = [&](const std::string& why) {
    for (auto& rk : ranks)
      if (!rk.done && rk.failure.empty()) {
        ::kill(rk.pid, SIGKILL);
        rk.failure = why;
      }
  };
  while (running > 0) {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<int> owner;
    for (int r = 0; r < nproc; ++r)
      for (Stream* s : {&ranks[r].out, &ranks[r].err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
          owner.push_back(r);
        }
    ::poll(fds.data(), fds.size(), 50);  // also wakes for signals and exits
    for (std::size_t k = 0; k < fds.size(); ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[65536];
      auto n = ::read(fds[k].fd, buf, sizeof buf);
      const std::string prefix = "[rank " + std::to_string(owner[k]) + "] ";
      if (n > 0) {
        streams[k]->partial.append(buf, static_cast<std::size_t>(n));
        streams[k]->flush_lines(prefix, false);
      } else if (n == 0 || errno != EINTR) {
        streams[k]->flush_lines(prefix, true);
        ::close(streams[k]->fd);
        streams[k]->fd = -1;
      }
    }
    if (g_signal != 0 && g_signal != forwarded) {  // forward once per signal; a second Ctrl-C ends it hard
      if (forwarded != 0) kill_rest("killed: corpcrun got a second signal");
      forwarded = g_signal;
      for (auto& rk : ranks)
        if (!rk.done) ::kill(rk.pid, forwarded);
      if (!kill_at) kill_at = Clock::now() + seconds(grace_s);
      kill_reason = "killed: still running " + std::to_string(static_cast<int>(grace_s)) + " s after corpcrun got " +
                    ::strsignal(forwarded);
      g_signal = 0;
    }
    for (int r = 0; r < nproc; ++r) {
      auto& rk = ranks[r];
      int status = 0;
      if (rk.done || ::waitpid(rk.pid, &status, WNOHANG) != rk.pid) continue;
      rk.done = true;
      --running;
      if (!rk.failure.empty()) continue;  // killed by us: the reason is already set
      if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
        rk.failure = "exited with code " + std::to_string(WEXITSTATUS(status));
      else if (WIFSIGNALED(status)) rk.failure = std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
      if (!rk.failure.empty() && !kill_at) {
        kill_at = Clock::now() + seconds(grace_s);
        kill_reason = "killed: still running " + std::to_string(static_cast<int>(grace_s)) + " s after rank " +
                      std::to_string(r) + " failed";
      }
    }
    const auto now = Clock::now();
    if (timeout_s > 0 && now - start > seconds(timeout_s))
      kill_rest("killed: timed out after " + std::to_string(static_cast<int>(timeout_s)) + " s");
    else if (kill_at && now > *kill_at) kill_rest(kill_reason);
  }
  // What the ranks wrote last (a grandchild that still holds a pipe open does not keep us waiting).
  for (int r = 0; r < nproc; ++r)
    for (Stream* s : {&ranks[r].out, &ranks[r].err}) {
      if (s->fd < 0) continue;
      ::fcntl(s->fd, F_SETFL, O_NONBLOCK);
      char buf[65536];
      for (ssize_t n; (n = ::read(s->fd, buf, sizeof buf)) > 0;) s->partial.append(buf, static_cast<std::size_t>(n));
      s->flush_lines("[rank " + std::to_string(r) + "] ", true);
      ::close(s->fd);
    }

  std::string failed;
  for (int r = 0; r < nproc; ++r)
    if (!ranks[r].failure.empty())
      failed += (failed.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " " + ranks[r].failure);
  if (failed.empty()) return 0;
  std::fprintf(stderr, "corpcrun: %s\n", failed.c_str());
  return 1;
}
