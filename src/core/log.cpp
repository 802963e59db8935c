#include "core/log.hpp"

#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "corpc/core/executor.hpp"

namespace corpc::detail {

namespace {

constexpr std::string_view kNames[] = {"debug", "info", "warn", "error", "off"};

LogLevel parse_level() {
  const char* v = std::getenv("CORPC_LOG");
  if (v == nullptr || *v == '\0') return LogLevel::warn;
  for (int i = 0; i < 5; ++i)
    if (kNames[i] == v) return static_cast<LogLevel>(i);
  std::fprintf(stderr, "corpc warn: CORPC_LOG=%s is not one of debug, info, warn, error, off; using warn\n", v);
  return LogLevel::warn;
}

// One write(2) per line where it fits, so that lines from concurrent threads and processes do not interleave.
void write_to_stderr(std::string_view line) noexcept {
  while (!line.empty()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data(), line.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    line.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Lines from threads that must never block (corpc's I/O threads: a stderr pipe that nobody drains would stop every
// connection they serve) wait here for one logger thread, which writes them out and may block in their place. The
// queue is bounded: when it is full, lines are dropped and the logger says how many.
class LogQueue {
 public:
  static LogQueue& instance() {
    // Leaked on purpose: the logger thread may still be writing while the process exits.
    static LogQueue* queue = [] {
      auto* q = new LogQueue;
      ::pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                       [] { instance().forget_after_fork(); });
      return q;
    }();
    return *queue;
  }

  bool logger_started() {
    std::lock_guard lock(mutex_);
    return started_;
  }

  void push(std::string&& line) noexcept {
    std::lock_guard lock(mutex_);
    if (!started_ && !start_logger()) return;
    if (queued_bytes_ + line.size() > kMaxQueuedBytes) {
      ++dropped_;
    } else {
      queued_bytes_ += line.size();
      try {
        lines_.push_back(std::move(line));
      } catch (...) {
        queued_bytes_ -= line.size();
        ++dropped_;
      }
    }
    wake_.notify_one();
  }

 private:
  static constexpr std::size_t kMaxQueuedBytes = 256 * 1024;

  bool start_logger() noexcept {
    try {
      std::thread([this] { run(); }).detach();
      started_ = true;
    } catch (...) {}
    return started_;
  }

  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return !lines_.empty() || dropped_ > 0; });
      std::deque<std::string> lines;
      lines.swap(lines_);
      const std::uint64_t dropped = std::exchange(dropped_, 0);
      queued_bytes_ = 0;
      lock.unlock();
      for (const auto& l : lines) write_to_stderr(l);
      if (dropped > 0) {
        write_to_stderr("corpc warn: " + std::to_string(dropped) +
                        " log lines dropped: stderr did not take them as fast as they came\n");
      }
      lock.lock();
    }
  }

  // In a forked child, which has no logger thread: the parent's lines are the parent's to write.
  void forget_after_fork() {
    lines_.clear();
    queued_bytes_ = 0;
    dropped_ = 0;
    started_ = false;
    mutex_.unlock();
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::string> lines_;
  std::size_t queued_bytes_ = 0;
  std::uint64_t dropped_ = 0;
  bool started_ = false;
};

}  // namespace

LogLevel log_level() {
  static const LogLevel level = parse_level();
  return level;
}

int fork_safe_threads() noexcept { return LogQueue::instance().logger_started() ? 1 : 0; }

void log_line(LogLevel level, std::string_view worker, std::string_view function, std::string_view message) {
  std::string line = fmt::format("corpc {} [{}{}{}]: {}\n", kNames[static_cast<int>(level)], worker,
                                 worker.empty() || function.empty() ? "" : ", ", function, message);
  // Other threads write at once: the order of their lines is kept, and a process that exits right after logging
  // (a failed rank) loses nothing.
  if (blocking_forbidden()) LogQueue::instance().push(std::move(line));
  else write_to_stderr(line);
}

}  // namespace corpc::detail
