/// @file
/// Where continuations run.
///
/// The resumption rule, used by every awaitable in corpc: a coroutine that suspends on a corpc awaitable resumes on the
/// executor that was current on its thread when it suspended. On a thread with no current executor (a plain thread
/// outside `sync_wait`, such as `main`), it resumes on the *default executor* — the runtime's worker pool while
/// `init_rpc` is active — and inline on the completing thread only when there is none (core-only programs).
/// The runtime's I/O threads are executors too: a coroutine function that runs on an I/O thread comes back to it.
///
/// Blocking (`Future::wait`, `rpc_sync`) is forbidden on I/O threads — it would stop the thread that must deliver
/// the value — and throws UsageError there at once. On a worker-pool thread it is allowed: the pool starts a
/// replacement thread while one blocks, so handlers that block on nested calls cannot starve the others.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "corpc/core/detail/blocking.hpp"

namespace corpc {

/// A unit of work that an executor runs once: what Executor::enqueue takes, so an executor of your own handles these.
/// Intrusive, so that an awaiting coroutine frame can itself be the queue node: resuming a coroutine on an executor
/// allocates nothing.
struct WorkItem {
  WorkItem* next = nullptr;                   ///< Queue link, owned by the executor while the item is queued.
  void (*run)(WorkItem*) noexcept = nullptr;  ///< Called once with the item itself; may free the item.
};

/// Something that runs WorkItems: the runtime's worker pool and I/O threads, a ThreadPool, a BoundedExecutor (strand),
/// the thread inside sync_wait. Coroutines resume on the executor current where they suspended (see
/// corpc/core/executor.hpp). Implement enqueue() (and running_here(), to allow inline resumption) to plug in your own.
class Executor {
 public:
  virtual ~Executor() = default;
  /// Queues `item` to run later on this executor; never runs it inline. `item` must stay alive until it has run.
  virtual void enqueue(WorkItem* item) noexcept = 0;
  /// True on a thread this executor drives (work for it may then run inline instead of being queued).
  virtual bool running_here() const noexcept { return false; }
  /// Convenience: queues a callable (allocates a node).
  void post(std::function<void()> job);
};

/// The executor driving the calling thread, or nullptr.
Executor* current_executor() noexcept;

/// Installs `e` as the calling thread's current executor for the guard's lifetime.
class ExecutorScope {
 public:
  /// Makes `e` (may be nullptr) current on the calling thread; the destructor restores the previous one.
  explicit ExecutorScope(Executor* e) noexcept;
  ~ExecutorScope();
  ExecutorScope(const ExecutorScope&) = delete;
  ExecutorScope& operator=(const ExecutorScope&) = delete;

 private:
  Executor* previous_;
};

/// Sets where continuations registered on executor-less threads run (nullptr: inline). init_rpc sets its worker
/// pool and shutdown clears it; a core-only program may set its own (it must outlive every continuation queued).
void set_default_executor(Executor* e) noexcept;
/// The executor set by set_default_executor, or nullptr.
Executor* default_executor() noexcept;

// ---- blocking ---------------------------------------------------------------------------------------------------

/// True on a thread that must not block: a corpc I/O thread.
bool blocking_forbidden() noexcept;
/// Throws UsageError naming `what` if the calling thread must not block.
void check_may_block(const char* what);

// ---- executors ----------------------------------------------------------------------------------------------------

/// A set of threads draining one FIFO queue. `stop()` finishes queued jobs, then joins. While a pool thread blocks
/// (in any of corpc's blocking waits) and work is queued, the pool starts a replacement so that `size()` threads stay
/// runnable; replacements exit when they are no longer needed (at most `max_threads` in all).
class ThreadPool final : public Executor {
 public:
  /// `on_start` runs first on each thread (thread-local settings such as intra-op thread counts).
  explicit ThreadPool(std::size_t threads, std::function<void()> on_start = {}, std::size_t max_threads = 512);
  ~ThreadPool() override;
  void enqueue(WorkItem* item) noexcept override;
  bool running_here() const noexcept override;
  /// Runs what is queued, then joins every thread (the destructor calls it). Work enqueued after it returns never runs.
  void stop();
  /// The number of threads kept runnable (the `threads` of the constructor).
  std::size_t size() const noexcept { return base_; }
  std::size_t threads_started() const noexcept;  ///< threads ever started, replacements included (for tests)

 private:
  friend class detail::BlockingRegion;
  void run();
  void start_thread();  // mutex_ held
  void block_begin();
  void block_end();

  std::function<void()> on_start_;
  const std::size_t base_, max_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  WorkItem* head_ = nullptr;
  WorkItem* tail_ = nullptr;
  std::size_t live_ = 0, idle_ = 0, blocked_ = 0, started_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

/// Runs at most `width` of its jobs at once, starting them in the order queued, on another executor. With width 1 it
/// is a strand (like Asio's): mutual exclusion without holding a thread while waiting for a turn. The underlying
/// executor must outlive the jobs.
class BoundedExecutor final : public Executor {
 public:
  /// Runs jobs on `underlying`, at most `width` (0 counts as 1) at a time. The destructor waits for queued jobs.
  explicit BoundedExecutor(Executor& underlying, std::size_t width = 1)
      : underlying_(underlying), width_(width ? width : 1) {}
  ~BoundedExecutor() override;
  void enqueue(WorkItem* item) noexcept override;

 private:
  // A turn on the underlying executor. It is handed its job under mutex_ when it is scheduled, so no two runners
  // can go for the same queued job.
  struct Runner : WorkItem {
    BoundedExecutor* owner;
    WorkItem* job;
  };
  static void run_one(WorkItem* self) noexcept;
  Executor& underlying_;
  const std::size_t width_;
  std::mutex mutex_;
  std::condition_variable drained_;
  WorkItem* head_ = nullptr;  // jobs waiting for a turn; only non-empty while `width_` runners are out
  WorkItem* tail_ = nullptr;
  std::size_t running_ = 0;  // runners scheduled or running
  std::vector<Runner*> free_runners_;
};

}  // namespace corpc
