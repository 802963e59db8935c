// corpc/core/executor.hpp — where continuations run.
//
// The resumption rule, used by every awaitable in corpc: a coroutine that suspends on a corpc awaitable resumes on the
// executor that was current on its thread when it suspended. A thread with no current executor (a plain thread outside
// `sync_wait`) has its continuations run inline by whichever thread completes the awaited future. The runtime's worker
// pool and `sync_wait` each install themselves as the current executor of the threads they drive; the network thread
// never runs user code.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace corpc {

class Executor {
 public:
  virtual ~Executor() = default;
  // Schedules `job` to run later on this executor; never runs it inline.
  virtual void post(std::function<void()> job) = 0;
};

// The executor driving the calling thread, or nullptr.
Executor* current_executor() noexcept;

// Installs `e` as the calling thread's current executor for the guard's lifetime.
class ExecutorScope {
 public:
  explicit ExecutorScope(Executor* e) noexcept;
  ~ExecutorScope();
  ExecutorScope(const ExecutorScope&) = delete;
  ExecutorScope& operator=(const ExecutorScope&) = delete;

 private:
  Executor* previous_;
};

// A fixed set of threads draining one FIFO queue. `stop()` finishes queued jobs, then joins.
class ThreadPool final : public Executor {
 public:
  // `on_start` runs first on each thread (thread-local settings such as intra-op thread counts).
  explicit ThreadPool(std::size_t threads, std::function<void()> on_start = {});
  ~ThreadPool() override;
  void post(std::function<void()> job) override;
  void stop();
  std::size_t size() const noexcept { return threads_.size(); }

 private:
  void run();
  std::function<void()> on_start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// Runs at most `width` of its jobs at once, starting them in the order posted, on another executor. With width 1 it
// is a strand (like Asio's): mutual exclusion without holding a thread while waiting for a turn. The underlying
// executor must outlive the jobs.
class BoundedExecutor final : public Executor {
 public:
  explicit BoundedExecutor(Executor& underlying, std::size_t width = 1) : underlying_(underlying), width_(width ? width : 1) {}
  void post(std::function<void()> job) override;

 private:
  void run_one();
  Executor& underlying_;
  const std::size_t width_;
  std::mutex mutex_;
  std::deque<std::function<void()>> queue_;
  std::size_t running_ = 0;
};

// An executor drained by hand, by the one thread that owns it (used by `sync_wait`).
class ManualExecutor final : public Executor {
 public:
  void post(std::function<void()> job) override;
  // Runs queued jobs until `done()` returns true; blocks while the queue is empty.
  void run_until(const std::function<bool()>& done);
  // Wakes `run_until` so that it re-checks its predicate.
  void notify();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

}  // namespace corpc
