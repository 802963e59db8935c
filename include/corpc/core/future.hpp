// corpc/core/future.hpp — eager, thread-safe, shareable results: Future<T> and its Promise<T>.
//
// A Future is a handle on a value that is being computed now (an RPC in flight, a spawned task). It is cheap to copy;
// all copies see the same result. Consume it by `co_await fut` in a coroutine, `fut.wait()` outside one, or
// `fut.then(f)`. Errors travel as exceptions: awaiting or waiting on a failed future rethrows its error.
//
// Where continuations run: see corpc/core/executor.hpp. `co_await` resumes on the executor current at suspension;
// `then` callbacks run on the executor current where `then` was called (inline on the completing thread if none).
#pragma once

#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "corpc/core/call_context.hpp"
#include "corpc/core/errors.hpp"
#include "corpc/core/executor.hpp"

namespace corpc {

template <class T>
class Future;
template <class T>
class Promise;

namespace detail {

// void results are stored as an empty struct so that one implementation serves every T.
template <class T>
using Stored = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// Wraps `fn` so that it runs with the caller's CallContext, on the caller's executor when it has one.
inline std::function<void()> bind_to_current(std::function<void()> fn) {
  CallContext ctx = current_call_context();
  auto with_ctx = [ctx, fn = std::move(fn)]() {
    CallContextScope scope(ctx);
    fn();
  };
  if (Executor* ex = current_executor()) {
    return [ex, job = std::move(with_ctx)]() mutable { ex->post(std::move(job)); };
  }
  return with_ctx;
}

template <class F, class T>
struct ThenResult {
  using type = std::invoke_result_t<F, const T&>;
};
template <class F>
struct ThenResult<F, void> {
  using type = std::invoke_result_t<F>;
};

template <class T>
class FutureState {
 public:
  bool ready() const {
    std::lock_guard lock(mutex_);
    return ready_;
  }

  // First completion wins; returns false if the state was already complete.
  template <class... A>
  bool set_value(A&&... a) {
    std::unique_lock lock(mutex_);
    if (ready_) return false;
    value_.emplace(std::forward<A>(a)...);
    return finish(lock);
  }
  bool set_exception(std::exception_ptr e) {
    std::unique_lock lock(mutex_);
    if (ready_) return false;
    error_ = std::move(e);
    return finish(lock);
  }

  // Runs `cb` inline when the state completes (at once if it already has), on the completing thread.
  void on_ready_inline(std::function<void()> cb) {
    {
      std::lock_guard lock(mutex_);
      if (!ready_) {
        callbacks_.push_back(std::move(cb));
        return;
      }
    }
    cb();
  }

  void wait() const {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return ready_; });
  }
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> d) const {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, d, [&] { return ready_; });
  }

  // Precondition: ready.
  const Stored<T>& get() const {
    if (error_) std::rethrow_exception(error_);
    return *value_;
  }
  std::exception_ptr error() const {
    std::lock_guard lock(mutex_);
    return error_;
  }

 private:
  bool finish(std::unique_lock<std::mutex>& lock) {
    ready_ = true;
    auto callbacks = std::move(callbacks_);
    callbacks_.clear();
    lock.unlock();
    cv_.notify_all();
    for (auto& cb : callbacks) {
      try {
        cb();
      } catch (...) {
        // A throwing callback must not keep the others from running, nor escape into the completing thread (which
        // may be the network thread). Callbacks report their own errors through the futures they complete.
      }
    }
    return true;
  }

  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  bool ready_ = false;
  std::optional<Stored<T>> value_;
  std::exception_ptr error_;
  std::vector<std::function<void()>> callbacks_;
};

}  // namespace detail

template <class T>
class Future {
 public:
  using value_type = T;

  Future() = default;  // an invalid future; `valid()` is false

  bool valid() const noexcept { return state_ != nullptr; }
  bool done() const { return state_->ready(); }
  bool has_error() const { return done() && state_->error() != nullptr; }
  std::exception_ptr error() const { return state_->error(); }

  // The value of a completed future (rethrows its error). Throws UsageError if it is not complete yet.
  decltype(auto) value() const {
    if (!done()) throw UsageError("Future::value() called before the future completed");
    if constexpr (std::is_void_v<T>) {
      state_->get();
    } else {
      return static_cast<const T&>(state_->get());
    }
  }

  // Blocks the calling thread until complete, then returns the value or rethrows the error.
  // Never call from a worker-pool thread when the completion needs that pool: use co_await there.
  decltype(auto) wait() const {
    state_->wait();
    return value();
  }
  // As wait(), but throws TimeoutError if the future is not complete after `timeout`.
  template <class Rep, class Period>
  decltype(auto) wait(std::chrono::duration<Rep, Period> timeout) const {
    if (!state_->wait_for(timeout)) throw TimeoutError("Future::wait timed out");
    return value();
  }

  // Calls `fn(value)` (or `fn()` for Future<void>) when this completes and returns a future of its result.
  // An error in this future, or thrown by `fn`, completes the returned future with that error; `fn` is skipped then.
  template <class F>
  auto then(F fn) const {
    return chain(std::move(fn), /*inline_on_completion=*/false);
  }

  // As then(), but `fn` runs inline on the completing thread whatever the executors: for short, non-blocking
  // functions whose result someone may wait() on from a thread that is itself an executor (no deadlock then).
  template <class F>
  auto then_inline(F fn) const {
    return chain(std::move(fn), /*inline_on_completion=*/true);
  }

  // Calls `fn()` once this completes, with value or error; inspect the future inside it. Runs per the executor rule.
  void on_complete(std::function<void()> fn) const { state_->on_ready_inline(detail::bind_to_current(std::move(fn))); }

  // Internal: runs `fn` inline on the completing thread. For corpc's own short, non-blocking bookkeeping.
  void on_complete_inline(std::function<void()> fn) const { state_->on_ready_inline(std::move(fn)); }

  // Resumption goes through bind_to_current, which also restores the coroutine's CallContext around it.
  struct Awaiter {
    std::shared_ptr<detail::FutureState<T>> state;
    bool await_ready() const { return state->ready(); }
    void await_suspend(std::coroutine_handle<> h) {
      state->on_ready_inline(detail::bind_to_current([h] { h.resume(); }));
    }
    T await_resume() {
      if constexpr (std::is_void_v<T>) {
        state->get();
      } else {
        return static_cast<const T&>(state->get());
      }
    }
  };
  Awaiter operator co_await() const { return Awaiter{state_}; }

  explicit Future(std::shared_ptr<detail::FutureState<T>> s) : state_(std::move(s)) {}

 private:
  template <class F>
  auto chain(F fn, bool inline_on_completion) const {
    using U = typename detail::ThenResult<F, T>::type;
    auto next = std::make_shared<detail::FutureState<U>>();
    auto self = state_;
    std::function<void()> run = [self, next, fn = std::move(fn)]() mutable {
      try {
        if constexpr (std::is_void_v<T>) {
          self->get();
          if constexpr (std::is_void_v<U>) {
            fn();
            next->set_value();
          } else {
            next->set_value(fn());
          }
        } else {
          if constexpr (std::is_void_v<U>) {
            fn(static_cast<const T&>(self->get()));
            next->set_value();
          } else {
            next->set_value(fn(static_cast<const T&>(self->get())));
          }
        }
      } catch (...) {
        next->set_exception(std::current_exception());
      }
    };
    if (inline_on_completion) on_complete_inline(std::move(run));
    else on_complete(std::move(run));
    return Future<U>(std::move(next));
  }

  std::shared_ptr<detail::FutureState<T>> state_;
};

// The write end of a Future. Move-only; the first completion wins. Destroying an unfulfilled promise fails its
// future with RpcError("broken promise") so that no waiter hangs.
template <class T>
class Promise {
 public:
  Promise() : state_(std::make_shared<detail::FutureState<T>>()) {}
  Promise(Promise&&) noexcept = default;
  Promise& operator=(Promise&& o) noexcept {
    if (this != &o) {
      abandon();
      state_ = std::move(o.state_);
    }
    return *this;
  }
  ~Promise() { abandon(); }

  Future<T> get_future() const { return Future<T>(state_); }

  template <class... A>
  bool set_value(A&&... a) {
    return state_->set_value(std::forward<A>(a)...);
  }
  bool set_exception(std::exception_ptr e) { return state_->set_exception(std::move(e)); }
  template <class E>
  bool set_error(E e) {
    return set_exception(std::make_exception_ptr(std::move(e)));
  }

 private:
  void abandon() {
    if (state_ && !state_->ready()) state_->set_exception(std::make_exception_ptr(RpcError("broken promise")));
  }
  std::shared_ptr<detail::FutureState<T>> state_;
};

template <class T>
Future<std::decay_t<T>> make_ready_future(T&& v) {
  Promise<std::decay_t<T>> p;
  p.set_value(std::forward<T>(v));
  return p.get_future();
}
inline Future<void> make_ready_future() {
  Promise<void> p;
  p.set_value();
  return p.get_future();
}
template <class T>
Future<T> make_exceptional_future(std::exception_ptr e) {
  Promise<T> p;
  p.set_exception(std::move(e));
  return p.get_future();
}

}  // namespace corpc
