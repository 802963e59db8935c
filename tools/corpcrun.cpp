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
#include <utility>
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

struct Options {
  int nproc = 2, max_rank_restarts = 0;
  double grace_s = 10, timeout_s = 0;
  char** command = nullptr;  // the program and its arguments, as execvp takes them
};

Options parse_arguments(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage(2);
      return argv[++i];
    };
    if (a == "-n" || a == "--nproc" || a == "--nproc_per_node") o.nproc = std::atoi(value());
    else if (a == "--grace") o.grace_s = std::atof(value());
    else if (a == "--timeout") o.timeout_s = std::atof(value());
    else if (a == "--max-rank-restarts") o.max_rank_restarts = std::atoi(value());
    else if (a == "-h" || a == "--help") usage(0);
    else if (a == "--") {
      ++i;
      break;
    } else if (a[0] == '-') usage(2);
    else break;
  }
  if (i >= argc || o.nproc <= 0 || o.max_rank_restarts < 0) usage(2);
  o.command = argv + i;
  return o;
}

// What the ranks of this run share.
struct Run {
  int port = 0;
  int listen_fd = -1;  // held open for rank 0's first process; -1 once closed (rank 0 never restarts)
  std::string secret;
  // This run's own key (src/transport/rank_identity.hpp): rank 0 checks with it that each rank, and each restart of
  // it, is the process this launcher started, whoever else holds the secret.
  std::string launcher_key;
};

Run prepare_run() {
  Run run;
  run.listen_fd = bind_master_socket(run.port);
  const char* caller_secret = std::getenv("CORPC_SECRET");
  run.secret = caller_secret && *caller_secret ? caller_secret : fresh_secret();
  run.launcher_key = corpc::detail::random_launcher_key();
  return run;
}

// SIGINT, SIGTERM and SIGHUP are noted (g_signal) and forwarded to the ranks by the watch loop.
void catch_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

std::string prefix_of(int r) { return "[rank " + std::to_string(r) + "] "; }

// The ranks of one run: starts them, passes their output on, forwards signals, restarts or ends them, and says how
// they ended.
class Launcher {
 public:
  Launcher(const Options& options, Run run)
      : o_(options), run_(std::move(run)), ranks_(options.nproc), running_(options.nproc) {}

  void start_all() {
    for (int r = 0; r < o_.nproc; ++r) start_rank(r, 0);
    ::close(run_.listen_fd);
    run_.listen_fd = -1;
    start_ = Clock::now();
  }

  // Until every rank has ended (or was killed).
  void watch() {
    while (running_ > 0) {
      pass_output();
      forward_signal();
      reap_exits();
      enforce_deadlines();
    }
    // What the ranks wrote last.
    for (int r = 0; r < o_.nproc; ++r)
      for (Stream* s : {&ranks_[r].out, &ranks_[r].err}) finish_stream(*s, prefix_of(r));
  }

  // 0 if every rank exited 0; else 1, after a line naming each failed rank and why.
  int exit_status() const {
    std::string failed;
    for (int r = 0; r < o_.nproc; ++r)
      if (!ranks_[r].failure.empty())
        failed += (failed.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " " + ranks_[r].failure);
    if (failed.empty()) return 0;
    std::fprintf(stderr, "corpcrun: %s\n", failed.c_str());
    return 1;
  }

 private:
  // Starts rank r's process; `restart` counts its restarts (0: its first process).
  void start_rank(int r, int restart) {
    std::fflush(stdout);
    std::fflush(stderr);
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) die("pipe");
    pid_t pid = ::fork();
    if (pid < 0) die("fork");
    if (pid == 0) exec_rank(r, restart, out[1], err[1]);
    ::close(out[1]);
    ::close(err[1]);
    ranks_[r].pid = pid;
    ranks_[r].out = Stream{out[0], stdout, {}};
    ranks_[r].err = Stream{err[0], stderr, {}};
    ranks_[r].restarts = restart;
  }

  // In the child: the rank's environment, then the program.
  [[noreturn]] void exec_rank(int r, int restart, int out_fd, int err_fd) const {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // ranks never outlive the launcher
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(err_fd, STDERR_FILENO);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE}) ::signal(sig, SIG_DFL);
    set_environment(r, restart);
    ::execvp(o_.command[0], o_.command);
    std::fprintf(stderr, "corpcrun: cannot run %s: %s\n", o_.command[0], std::strerror(errno));
    ::_exit(127);
  }

  // In the child: what the rank reads of its place in the run (see the top of this file); only rank 0 keeps the
  // master socket.
  void set_environment(int r, int restart) const {
    auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
    set("RANK", std::to_string(r));
    set("LOCAL_RANK", std::to_string(r));
    set("WORLD_SIZE", std::to_string(o_.nproc));
    set("LOCAL_WORLD_SIZE", std::to_string(o_.nproc));
    set("MASTER_ADDR", "127.0.0.1");
    set("MASTER_PORT", std::to_string(run_.port));
    set("CORPC_SECRET", run_.secret);
    set("CORPC_RANK_CREDENTIAL",
        corpc::detail::rank_credential(run_.launcher_key, r, static_cast<std::uint32_t>(restart)));
    if (r == 0) {
      set("CORPC_RANK_KEY", run_.launcher_key);
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
      set("CORPC_LISTEN_FD", std::to_string(run_.listen_fd));
    } else {
      if (run_.listen_fd >= 0) ::close(run_.listen_fd);
      ::unsetenv("CORPC_LISTEN_FD");
    }
  }

  // Waits up to 50 ms for output, and passes on what came, a line at a time.
  void pass_output() {
    std::vector<pollfd> fds;
    std::vector<Stream*> streams;
    std::vector<int> owner;
    for (int r = 0; r < o_.nproc; ++r)
      for (Stream* s : {&ranks_[r].out, &ranks_[r].err})
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
      const std::string prefix = prefix_of(owner[k]);
      if (n > 0) {
        streams[k]->partial.append(buf, static_cast<std::size_t>(n));
        streams[k]->flush_lines(prefix, false);
      } else if (n == 0 || errno != EINTR) {
        streams[k]->flush_lines(prefix, true);
        ::close(streams[k]->fd);
        streams[k]->fd = -1;
      }
    }
  }

  // Forwards a signal corpcrun got to every rank, once per signal; a second one ends the run hard.
  void forward_signal() {
    if (g_signal == 0 || g_signal == forwarded_) return;
    if (forwarded_ != 0) kill_rest("killed: corpcrun got a second signal");
    forwarded_ = g_signal;
    for (auto& rk : ranks_)
      if (!rk.done) ::kill(rk.pid, forwarded_);
    if (!kill_at_) kill_at_ = Clock::now() + seconds(o_.grace_s);
    kill_reason_ = "killed: still running " + std::to_string(static_cast<int>(o_.grace_s)) + " s after corpcrun got " +
                   ::strsignal(forwarded_);
    g_signal = 0;
  }

  void reap_exits() {
    for (int r = 0; r < o_.nproc; ++r) {
      auto& rk = ranks_[r];
      int status = 0;
      if (rk.done || ::waitpid(rk.pid, &status, WNOHANG) != rk.pid) continue;
      if (!rk.failure.empty()) {  // killed by us: the reason is already set
        rk.done = true;
        --running_;
        continue;
      }
      const std::string failure = failure_of(status);
      if (!failure.empty() && may_restart(r)) restart(r, failure);
      else end(r, failure);
    }
  }

  static std::string failure_of(int status) {
    if (WIFEXITED(status) && WEXITSTATUS(status) != 0) return "exited with code " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return std::string("killed by signal ") + ::strsignal(WTERMSIG(status));
    return {};
  }

  // In place, while the run is not ending (no failure, no signal, no timeout yet): the others go on.
  bool may_restart(int r) const {
    return r != 0 && ranks_[r].restarts < o_.max_rank_restarts && !kill_at_ && !timed_out(Clock::now());
  }

  void restart(int r, const std::string& failure) {
    auto& rk = ranks_[r];
    finish_stream(rk.out, prefix_of(r));
    finish_stream(rk.err, prefix_of(r));
    std::fprintf(stderr, "corpcrun: warning: rank %d %s; restarting it in place (restart %d of %d)\n", r,
                 failure.c_str(), rk.restarts + 1, o_.max_rank_restarts);
    start_rank(r, rk.restarts + 1);
  }

  // Rank r has ended for good; a failure gives the others the grace period.
  void end(int r, const std::string& failure) {
    auto& rk = ranks_[r];
    rk.done = true;
    --running_;
    rk.failure = failure;
    if (!rk.failure.empty() && rk.restarts > 0) rk.failure += " (after " + std::to_string(rk.restarts) + " restart(s))";
    if (!rk.failure.empty() && !kill_at_) {
      kill_at_ = Clock::now() + seconds(o_.grace_s);
      kill_reason_ = "killed: still running " + std::to_string(static_cast<int>(o_.grace_s)) + " s after rank " +
                     std::to_string(r) + " failed";
    }
  }

  bool timed_out(Clock::time_point now) const { return o_.timeout_s > 0 && now - start_ > seconds(o_.timeout_s); }

  void enforce_deadlines() {
    const auto now = Clock::now();
    if (timed_out(now)) kill_rest("killed: timed out after " + std::to_string(static_cast<int>(o_.timeout_s)) + " s");
    else if (kill_at_ && now > *kill_at_) kill_rest(kill_reason_);
  }

  void kill_rest(const std::string& why) {
    for (auto& rk : ranks_)
      if (!rk.done && rk.failure.empty()) {
        ::kill(rk.pid, SIGKILL);
        rk.failure = why;
      }
  }

  const Options o_;
  Run run_;
  std::vector<Rank> ranks_;
  Clock::time_point start_;
  std::optional<Clock::time_point> kill_at_;  // the end of the grace period, once a rank failed or a signal came
  std::string kill_reason_;
  int running_;        // ranks not done
  int forwarded_ = 0;  // the last signal forwarded
};

}  // namespace

int main(int argc, char** argv) {
  const Options options = parse_arguments(argc, argv);
  Launcher launcher(options, prepare_run());
  catch_signals();
  launcher.start_all();
  launcher.watch();
  return launcher.exit_status();
}
