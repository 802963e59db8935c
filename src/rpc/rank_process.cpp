// A rank's process: how it starts (fork, or fork and exec of this program), runs, reports and ends.
#include "rpc/rank_process.hpp"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>

#include "corpc/rpc/errors.hpp"

#include "core/exception_text.hpp"
#include "core/log.hpp"
#include "rpc/environment.hpp"
#include "rpc/launch_protocol.hpp"
#include "rpc/runtime_exit.hpp"
#include "transport/launcher_key.hpp"

namespace corpc::detail {
namespace {

// The rank this process runs, for the crash handler (set before it is installed; a signal handler reads no
// environment).
volatile sig_atomic_t g_crashing_rank = -1;

// A crashing rank prints where, so that the report says more than "signal 11".
void print_backtrace_and_die(int sig) {
  void* frames[64];
  int n = ::backtrace(frames, 64);
  char head[96];
  int len = std::snprintf(head, sizeof head, "[rank %d] fatal signal %d; backtrace:\n",
                          static_cast<int>(g_crashing_rank), sig);
  auto w = ::write(STDERR_FILENO, head, static_cast<std::size_t>(len));
  (void)w;
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

}  // namespace

// Runs one rank's function; a runtime it left running is shut down for it. Returns why the rank failed ("" if not).
std::string run_rank(int rank, const std::function<void(int)>& fn) {
  std::string error;
  try {
    fn(rank);
  } catch (...) {
    error = exception_text(std::current_exception());
  }
  try {
    std::string left = close_runtime_left_open(error);
    if (error.empty()) error = std::move(left);
  } catch (...) {
    if (error.empty()) error = exception_text(std::current_exception());
  }
  return error;
}

[[noreturn]] void run_rank_and_exit(int rank, int report_fd, const std::function<void(int)>& fn) {
  g_crashing_rank = rank;
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, print_backtrace_and_die);
  auto n = ::write(report_fd, &kStarted, 1);
  std::string error = run_rank(rank, fn);
#if defined(__SANITIZE_ADDRESS__)
  // Ranks leave through _exit, which skips LeakSanitizer's exit-time check: run it here, once the rank is done.
  // CORPC_RANK_LEAK_CHECK=0 skips it: in a forked rank the check writes to every heap chunk the parent allocated
  // (libtorch's registries), copying the whole inherited heap page by page, seconds per rank.
  if (error.empty() && rank_leak_check_from_environment() && __lsan_do_recoverable_leak_check() != 0)
    error = "LeakSanitizer found leaks (report above)";
#endif
  if (!error.empty()) {
    detail::log(LogLevel::error, "rank " + std::to_string(rank), "launch_processes", "failed: {}", error);
    n = ::write(report_fd, error.data(), error.size());
  }
  (void)n;
  std::fflush(stdout);
  std::fflush(stderr);
  ::_exit(error.empty() ? 0 : 1);
}

std::vector<std::pair<std::string, std::string>> rank_environment(int rank, int world_size, int port,
                                                                  const std::string& secret, int restart,
                                                                  const RankSecrets& secrets) {
  std::vector<std::pair<std::string, std::string>> vars{
      {"MASTER_ADDR", "127.0.0.1"},
      {"MASTER_PORT", std::to_string(port)},
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world_size)},
      {"LOCAL_WORLD_SIZE", std::to_string(world_size)},
      {"CORPC_SECRET", secret},  // connections between this run's ranks authenticate with it
      {kLaunched, "1"},
      {kRankCredential, std::string(secrets.credential())}};
  if (rank == 0) vars.emplace_back(kRankKey, std::string(secrets.key()));
  if (restart > 0) {
    vars.emplace_back(kRejoin, "1");
    vars.emplace_back(kRankRestart, std::to_string(restart));
  }
  return vars;
}

[[noreturn]] void run_forked_child(int rank, int world_size, int port, int listen_fd, int report_fd,
                                   const std::string& secret, int restart, const RankSecrets& secrets,
                                   const std::function<void(int)>& fn) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  for (const char* v : {kRejoin, kRankRestart, kRankKey}) ::unsetenv(v);
  for (auto& [k, v] : rank_environment(rank, world_size, port, secret, restart, secrets))
    ::setenv(k.c_str(), v.c_str(), 1);
  if (rank == 0) {
    ::setenv("CORPC_LISTEN_FD", std::to_string(listen_fd).c_str(), 1);
  } else {
    if (listen_fd >= 0) ::close(listen_fd);
    ::unsetenv("CORPC_LISTEN_FD");
  }
  run_rank_and_exit(rank, report_fd, fn);
}

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

}  // namespace corpc::detail
