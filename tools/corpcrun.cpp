// corpcrun — start N ranks of any corpc program on this host, as `torchrun --standalone --nproc_per_node N
// --no_python` does for a binary:
//
//   corpcrun -n 4 ./train --epochs 3
//
// Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a port the OS
// chose, held open for rank 0 as CORPC_LISTEN_FD so that concurrent runs never collide) and one CORPC_SECRET for the
// run (the caller's if set). Output lines are prefixed with "[rank N] ". SIGINT, SIGTERM and SIGHUP are forwarded to
// every rank. When a rank fails the others get a grace period, then are killed; the exit status is non-zero and the
// last line names each failed rank and why. With --max-rank-restarts N, a rank other than 0 that fails is first started
// again in place, up to N times, with CORPC_REJOIN=1 and CORPC_RANK_RESTART=<n> (as launch_processes does, see
// corpc/rpc/launch.hpp), while the others keep running. Torch-free on purpose: it links nothing of corpc.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
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

#include "core/loopback_listener.hpp"
#include "transport/mac.hpp"
#include "transport/rank_identity.hpp"

namespace {

using Clock = std::chrono::steady_clock;

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

volatile sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

[[noreturn]] void usage(int code) {
  std::fprintf(code ? stderr : stdout,
               "usage: corpcrun [-n N] [--grace SECONDS] [--timeout SECONDS] [--max-rank-restarts N] [--] PROGRAM "
               "[ARGS...]\n"
               "  -n, --nproc N            ranks to start on this host (default 2)\n"
               "  --grace S                after a rank fails, seconds before the others are killed (default 10)\n"
               "  --timeout S              kill every rank after S seconds, restarts included (default: none)\n"
               "  --max-rank-restarts N    start a failed rank other than 0 again in place, up to N times per rank,\n"
               "                           with CORPC_REJOIN=1 and CORPC_RANK_RESTART=<n>; the others keep running\n"
               "                           (default 0: a failed rank fails the run)\n");
  std::exit(code);
}

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "corpcrun: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(2);
}

int bind_master_socket(int& port) {
  const int fd = corpc::detail::listen_on_loopback(port, /*keep_across_exec=*/true);  // rank 0 is a new program
  if (fd < 0) die("cannot bind a port on 127.0.0.1");
  return fd;
}

std::string fresh_secret() {
  unsigned char bytes[32];
  if (!corpc::detail::random_bytes(bytes, sizeof bytes)) die("no randomness for a secret");
  return corpc::detail::hex(bytes, sizeof bytes);
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
  int restarts = 0;     // how many times this rank was started again after failing
};

// Passes on what is left in a stream whose process has ended (a grandchild that still holds the pipe open does not
// keep us waiting), and closes it.
void finish_stream(Stream& s, const std::string& prefix) {
  if (s.fd < 0) return;
  ::fcntl(s.fd, F_SETFL, O_NONBLOCK);
  char buf[65536];
  for (ssize_t n; (n = ::read(s.fd, buf, sizeof buf)) > 0;) s.partial.append(buf, static_cast<std::size_t>(n));
  s.flush_lines(prefix, true);
  ::close(s.fd);
  s.fd = -1;
}

}  // namespace

int main(int argc, char** argv) {
  int nproc = 2, max_rank_restarts = 0;
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
    else if (a == "--max-rank-restarts") max_rank_restarts = std::atoi(value());
    else if (a == "-h" || a == "--help") usage(0);
    else if (a == "--") {
      ++i;
      break;
    } else if (a[0] == '-') usage(2);
    else break;
  }
  if (i >= argc || nproc <= 0 || max_rank_restarts < 0) usage(2);
  char** command = argv + i;

  int port = 0;
  const int listen_fd = bind_master_socket(port);
  const char* caller_secret = std::getenv("CORPC_SECRET");
  const std::string secret = caller_secret && *caller_secret ? caller_secret : fresh_secret();
  // This run's own key (src/transport/rank_identity.hpp): rank 0 checks with it that each rank, and each restart of it,
  // is the process this launcher started, whoever else holds the secret.
  const std::string launcher_key = corpc::detail::random_launcher_key();

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<Rank> ranks(nproc);
  int open_listen_fd = listen_fd;  // -1 once closed: only rank 0's first process gets it, and rank 0 never restarts
  // Starts rank r's process; `restart` counts its restarts (0: its first process).
  auto start_rank = [&](int r, int restart) {
    std::fflush(stdout);
    std::fflush(stderr);
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
      set("CORPC_RANK_CREDENTIAL", corpc::detail::rank_credential(launcher_key, r, static_cast<std::uint32_t>(restart)));
      if (r == 0) {
        set("CORPC_RANK_KEY", launcher_key);
      } else {
        ::unsetenv("CORPC_RANK_KEY");
      }
      if (restart > 0) {
        set("CORPC_REJOIN", "1");  // join the running job instead of its initial rendezvous
        set("CORPC_RANK_RESTART", std::to_string(restart));
      } else {
        ::unsetenv("CORPC_REJOIN");
        ::unsetenv("CORPC_RANK_RESTART");
      }
      if (r == 0) {
        set("CORPC_LISTEN_FD", std::to_string(open_listen_fd));
      } else {
        if (open_listen_fd >= 0) ::close(open_listen_fd);
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
    ranks[r].restarts = restart;
  };
  for (int r = 0; r < nproc; ++r) start_rank(r, 0);
  ::close(listen_fd);
  open_listen_fd = -1;

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
      if (!rk.failure.empty()) {  // killed by us: the reason is already set
        rk.done = true;
        --running;
        continue;
      }
      std::string failure;
      if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
        failure = "exited with code " + std::to_string(WEXITSTATUS(status));
      else if (WIFSIGNALED(status)) failure = std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
      // In place, while the run is not ending (no failure, no signal, no timeout yet): the others go on.
      if (!failure.empty() && r != 0 && rk.restarts < max_rank_restarts && !kill_at &&
          !(timeout_s > 0 && Clock::now() - start > seconds(timeout_s))) {
        const std::string prefix = "[rank " + std::to_string(r) + "] ";
        finish_stream(rk.out, prefix);
        finish_stream(rk.err, prefix);
        std::fprintf(stderr, "corpcrun: warning: rank %d %s; restarting it in place (restart %d of %d)\n", r,
                     failure.c_str(), rk.restarts + 1, max_rank_restarts);
        start_rank(r, rk.restarts + 1);
        continue;
      }
      rk.done = true;
      --running;
      rk.failure = failure;
      if (!rk.failure.empty() && rk.restarts > 0)
        rk.failure += " (after " + std::to_string(rk.restarts) + " restart(s))";
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
  // What the ranks wrote last.
  for (int r = 0; r < nproc; ++r)
    for (Stream* s : {&ranks[r].out, &ranks[r].err}) finish_stream(*s, "[rank " + std::to_string(r) + "] ");

  std::string failed;
  for (int r = 0; r < nproc; ++r)
    if (!ranks[r].failure.empty())
      failed += (failed.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " " + ranks[r].failure);
  if (failed.empty()) return 0;
  std::fprintf(stderr, "corpcrun: %s\n", failed.c_str());
  return 1;
}
