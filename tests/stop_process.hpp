// Stopping another process for a fault test, for certain: kill(SIGSTOP) only queues the signal, and a thread of the
// target that is running at that moment (an I/O thread on the other vCPU) can still answer one more message before
// it stops, which turned a "stopped during to_here" case into a successful to_here once in a CI run.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace corpc::test {

// True when every thread of `pid` is in the stopped state ('T' in /proc/<pid>/task/<tid>/stat).
inline bool all_threads_stopped(pid_t pid) {
  std::error_code ec;
  int seen = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::ifstream in(task.path() / "stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;  // the thread ended meanwhile
    const auto close = stat.rfind(')');     // the state follows the command name, which may hold spaces
    if (close == std::string::npos || close + 2 >= stat.size() || stat[close + 2] != 'T') return false;
    ++seen;
  }
  return !ec && seen > 0;
}

// Returns once every thread of `pid` has stopped (throws after 10 s): for a stop sent by someone else, e.g. the
// process raising SIGSTOP itself from a pool thread.
inline void wait_until_stopped(pid_t pid) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!all_threads_stopped(pid)) {
    if (std::chrono::steady_clock::now() > give_up)
      throw std::runtime_error("process " + std::to_string(pid) + " did not stop within 10 s of SIGSTOP");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// Sends SIGSTOP to `pid` and returns once all its threads have stopped (throws after 10 s).
inline void stop_process(pid_t pid) {
  ::kill(pid, SIGSTOP);
  wait_until_stopped(pid);
}

}  // namespace corpc::test
