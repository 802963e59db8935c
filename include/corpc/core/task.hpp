/// @file
/// Task<T>: a lazy coroutine, started when awaited (or by spawn / sync_wait).
///
/// A Task does nothing until it is awaited; its result is delivered to exactly one awaiter. Awaiting a task transfers
/// control to it symmetrically (no stack growth on long chains). To run one eagerly, `spawn` turns it into a Future.
#pragma once

#include <coroutine>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

#include "corpc/core/future.hpp"

namespace corpc {

template <class T = void>
class Task;

namespace detail {

struct TaskPromiseBase {
  std::coroutine_handle<> continuation = std::noop_coroutine();
  std::exception_ptr error;

  std::suspend_always initial_suspend() noexcept { return {}; }
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <class P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      return h.promise().continuation;
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { error = std::current_exception(); }
};

template <class T>
struct TaskPromise : TaskPromiseBase {
  std::optional<T> value;
  Task<T> get_return_object() noexcept;
  template <class U>
  void return_value(U&& v) {
    value.emplace(std::forward<U>(v));
  }
  T take() {
    if (error) std::rethrow_exception(error);
    return std::move(*value);
  }
};

template <>
struct TaskPromise<void> : TaskPromiseBase {
  Task<void> get_return_object() noexcept;
  void return_void() noexcept {}
  void take() {
    if (error) std::rethrow_exception(error);
  }
};

}  // namespace detail

/// A lazy coroutine returning `T` (see corpc/core/task.hpp): write `corpc::Task<int> f() { co_return 1; }`.
/// It starts when awaited (`co_await f()`, which runs it on the awaiting thread until its first suspension and gives
/// its value or rethrows its exception) or when handed to spawn(), TaskScope::spawn() or sync_wait(). Move-only;
/// destroying a task that never started destroys its frame without running it.
template <class T>
class [[nodiscard]] Task {
 public:
  /// @cond INTERNAL
  using promise_type = detail::TaskPromise<T>;
  /// @endcond
  using value_type = T;  ///< What `co_await` on the task gives.

  Task() = default;  ///< An empty task (`valid()` is false); only assignment is allowed on it.
  /// @cond INTERNAL
  explicit Task(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
  /// @endcond
  /// Takes over `o`'s coroutine; `o` becomes empty.
  Task(Task&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  /// Destroys this task's coroutine (if any), then takes over `o`'s.
  Task& operator=(Task&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  ~Task() {
    if (h_) h_.destroy();
  }

  /// True if the task holds a coroutine (not default-constructed or moved from).
  bool valid() const noexcept { return static_cast<bool>(h_); }

  /// @cond INTERNAL
  struct Awaiter {
    std::coroutine_handle<promise_type> h;
    bool await_ready() const noexcept { return false; }
    std::coroutine_handle<> await_suspend(std::coroutine_handle<> caller) noexcept {
      h.promise().continuation = caller;
      return h;
    }
    T await_resume() { return h.promise().take(); }
  };
  /// @endcond
  /// `co_await std::move(task)` (or `co_await f()`): starts the task at once on this thread by symmetric transfer
  /// and resumes the awaiter where the task finishes; returns its value or rethrows its exception. Once only.
  Awaiter operator co_await() && noexcept { return Awaiter{h_}; }

 private:
  std::coroutine_handle<promise_type> h_;
};

namespace detail {
template <class T>
Task<T> TaskPromise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<TaskPromise<T>>::from_promise(*this));
}
inline Task<void> TaskPromise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<TaskPromise<void>>::from_promise(*this));
}

// A fire-and-forget coroutine frame that destroys itself when it ends. Used only inside spawn.
struct Detached {
  struct promise_type {
    Detached get_return_object() noexcept { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
};

template <class T>
Detached drive(Task<T> task, Promise<T> promise) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(task);
      promise.set_value();
    } else {
      promise.set_value(co_await std::move(task));
    }
  } catch (...) {
    promise.set_exception(std::current_exception());
  }
}
// A task queued to start on an executor, with the starter's CallContext.
template <class T>
struct SpawnJob : WorkItem {
  Task<T> task;
  Promise<T> promise;
  CallContext ctx = current_call_context();
  SpawnJob(Task<T> t, Promise<T> p) : task(std::move(t)), promise(std::move(p)) {
    run = [](WorkItem* w) noexcept {
      auto* self = static_cast<SpawnJob*>(w);
      {
        CallContextScope scope(self->ctx);
        drive(std::move(self->task), std::move(self->promise));
      }
      delete self;
    };
  }
};
}  // namespace detail

/// Starts `task` now, on the calling thread, until its first suspension; returns a Future of its result. Whatever
/// ambient state the task sets (a distributed-autograd context it opens) stays with the task: the calling thread's own
/// CallContext is restored when control comes back here.
template <class T>
Future<T> spawn(Task<T> task) {
  Promise<T> promise;
  auto fut = promise.get_future();
  CallContextScope keep(current_call_context());
  detail::drive(std::move(task), std::move(promise));
  return fut;
}

/// Starts `task` on `executor` (it begins when the executor runs the job); returns a Future of its result.
template <class T>
Future<T> spawn(Executor& executor, Task<T> task) {
  Promise<T> promise;
  auto fut = promise.get_future();
  executor.enqueue(new detail::SpawnJob<T>(std::move(task), std::move(promise)));
  return fut;
}

}  // namespace corpc
