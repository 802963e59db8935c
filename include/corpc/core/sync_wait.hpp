/// @file
/// The boundary between blocking code and coroutines.
///
/// `sync_wait(task)` runs a Task to completion on the calling thread: the thread becomes the task's executor, so the
/// task's continuations come back to it (a `main` that awaits RPCs stays on the main thread) and it never blocks a
/// worker-pool thread. Throws UsageError on a corpc I/O thread.
#pragma once

#include <atomic>

#include "corpc/core/detail/manual_executor.hpp"
#include "corpc/core/task.hpp"

namespace corpc {

/// Runs `task` to completion on the calling thread and returns its value (or rethrows its exception); the thread
/// drives the task's continuations meanwhile. For `main` and plain threads: throws UsageError on a corpc I/O thread.
template <class T>
T sync_wait(Task<T> task) {
  check_may_block("sync_wait");
  static thread_local detail::ManualExecutor executor;
  ExecutorScope scope(&executor);
  std::atomic<bool> finished{false};
  Future<T> fut = spawn(std::move(task));
  // The store is the callback's last touch of this frame; notify() touches only the thread-local executor.
  detail::on_ready_inline(fut, [&finished, owner = &executor] {
    finished.store(true, std::memory_order_release);
    owner->notify();
  });
  executor.run_until(finished);
  return std::move(fut).value();
}

}  // namespace corpc
