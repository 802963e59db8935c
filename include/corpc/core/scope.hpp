/// @file
/// TaskScope: owns work that was started and not awaited, so that it can be stopped and joined.
///
/// Fire-and-forget work is where lifetimes go wrong: a detached task outlives the objects it uses, or shutdown has to
/// guess when it is over. A TaskScope (folly's AsyncScope, P2300's counting_scope) counts what it started:
///
/// ```cpp
///   corpc::TaskScope scope;
///   for (auto& peer : peers) (void)scope.spawn(refresh(peer));  // each runs now until its first suspension
///   ...
///   co_await scope.stop_and_join();  // asks every task to stop, then waits until all have finished
/// ```
///
/// Tasks started in a scope see the scope's stop token (corpc::this_call::stop_token()): once a stop is requested,
/// their awaits of corpc futures complete with CancelledError (an RPC in flight is cancelled on its callee), so they
/// unwind at their next suspension point. `join()` closes the scope — later `spawn`s throw UsageError — and completes
/// when the last task has finished. Each `spawn` also returns the task's own Future, which may be ignored.
/// `when_empty()` waits for the scope to have nothing running without closing it (a runtime draining its background
/// work before it decides to stop). A scope must be joined before it is destroyed; the destructor of a scope with work
/// still running requests a stop and blocks until it is joined (which throws UsageError on an I/O thread: join with
/// co_await there).
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <stop_token>
#include <vector>

#include "corpc/core/task.hpp"

namespace corpc {

/// Owns tasks that were started and not awaited, so that they can be stopped and joined (see corpc/core/scope.hpp).
/// Thread-safe: spawn, request_stop, active and when_empty may be called from any thread; join once.
class TaskScope {
 public:
  TaskScope() = default;
  TaskScope(const TaskScope&) = delete;
  TaskScope& operator=(const TaskScope&) = delete;
  ~TaskScope() {
    if (active() == 0) return;
    request_stop();
    try {
      join().wait();
    } catch (...) {
      std::terminate();  // destroyed with work running on a thread that cannot wait for it
    }
  }

  /// Starts `task` on this thread, until its first suspension, inside the scope.
  template <class T>
  Future<T> spawn(Task<T> task) {
    enter();
    CallContextScope ctx(scoped_context());
    return corpc::spawn(run(std::move(task)));
  }
  /// Starts `task` on `executor`, inside the scope.
  template <class T>
  Future<T> spawn(Executor& executor, Task<T> task) {
    enter();
    CallContextScope ctx(scoped_context());
    return corpc::spawn(executor, run(std::move(task)));
  }

  /// Stops every task's awaits of corpc futures (they complete with CancelledError); does not close the scope.
  void request_stop() noexcept { stop_.request_stop(); }
  /// The token that the scope's tasks see as corpc::this_call::stop_token().
  std::stop_token stop_token() const noexcept { return stop_.get_token(); }
  /// Tasks started and not finished yet.
  std::size_t active() const noexcept { return count_.load(std::memory_order_acquire) - (closed() ? 0 : 1); }

  /// Closes the scope; the future completes when every task in it has finished. Call once.
  Future<void> join() {
    if (closing_.exchange(true, std::memory_order_acq_rel)) throw UsageError("TaskScope::join called twice");
    Future<void> done = joined_.get_future();
    leave();  // the scope's own count, held while it was open
    return done;
  }
  /// request_stop(), then join().
  Future<void> stop_and_join() {
    request_stop();
    return join();
  }
  /// Completes at the first moment no task is running (at once if none is now); the scope stays open, so a task may
  /// have started again by the time the future's continuation runs.
  Future<void> when_empty() {
    std::lock_guard lock(empty_mutex_);
    if (active() == 0) return make_ready_future();
    return empty_waiters_.emplace_back().get_future();
  }

 private:
  bool closed() const noexcept { return closing_.load(std::memory_order_acquire); }
  void enter() {
    // Count first, then check: a join racing with this spawn either sees the count or is seen as closed.
    count_.fetch_add(1, std::memory_order_acq_rel);
    if (closed()) {
      leave();
      throw UsageError("TaskScope: spawn after join");
    }
  }
  void leave() noexcept {
    const std::size_t before = count_.fetch_sub(1, std::memory_order_acq_rel);
    if (before == 1) joined_.set_value();
    if (before == 1 || (before == 2 && !closed())) notify_empty();
  }
  // Waiters registered before the count reached zero are woken; one that registers later saw zero itself.
  void notify_empty() noexcept {
    std::vector<Promise<void>> waiters;
    {
      std::lock_guard lock(empty_mutex_);
      waiters.swap(empty_waiters_);
    }
    for (auto& w : waiters) w.set_value();
  }
  CallContext scoped_context() const {
    CallContext c = current_call_context();
    c.stop = stop_.get_token();
    return c;
  }
  // Leaves the scope when the task's frame ends, whatever the outcome.
  template <class T>
  Task<T> run(Task<T> task) {
    struct Leave {
      TaskScope* scope;
      ~Leave() { scope->leave(); }
    } leave{this};
    co_return co_await std::move(task);
  }

  std::stop_source stop_;
  std::atomic<std::size_t> count_{1};  // tasks running, plus one while the scope is open
  std::atomic<bool> closing_{false};
  Promise<void> joined_;
  std::mutex empty_mutex_;
  std::vector<Promise<void>> empty_waiters_;
};

}  // namespace corpc
