// corpc/core/sync_wait.hpp — the boundary between blocking code and coroutines.
//
// `sync_wait(task)` runs a Task to completion on the calling thread: the thread becomes the task's executor, so the
// task's continuations come back to it (a `main` that awaits RPCs stays on the main thread) and it never blocks a
// worker-pool thread.
#pragma once

#include <atomic>
#include <memory>

#include "corpc/core/task.hpp"

namespace corpc {

template <class T>
decltype(auto) sync_wait(Task<T> task) {
  static thread_local ManualExecutor executor;
  ExecutorScope scope(&executor);
  Future<T> fut = spawn(std::move(task));
  // notify() after completion lets run_until re-check `done`; the shared flag outlives a late callback.
  auto finished = std::make_shared<std::atomic<bool>>(false);
  ManualExecutor* owner = &executor;  // a thread_local named inside the lambda would be the completing thread's
  fut.on_complete_inline([finished, owner] {
    finished->store(true);
    owner->notify();
  });
  executor.run_until([&] { return finished->load(); });
  if constexpr (std::is_void_v<T>) {
    fut.value();
  } else {
    return T(fut.value());
  }
}

}  // namespace corpc
