/// @file
/// Eager, thread-safe, shareable results: Future<T> and its Promise<T>.
///
/// A Future is a handle on a value that is being computed now (an RPC in flight, a spawned task). Copies share one
/// result. Consume it in one of two ways:
///   - `co_await fut` in a coroutine (resumes per the rule in corpc/core/executor.hpp), or `fut.wait()` outside one;
///   - `fut.then(f)`, which returns the Future of `f`'s result; `f` runs on the executor current where `then` was
///     called (the runtime's worker pool on a plain thread).
///
/// Errors travel as exceptions: awaiting or waiting on a failed future rethrows its error.
///
/// Cancellation: `fut.cancel()` asks the work behind the future to stop (an RPC sends a cancel to its callee; a
/// when_all cancels its inputs) and completes the future — every copy — with CancelledError unless it completed
/// already; `cancelled()` tells that outcome from value and error. A coroutine running cancellable work (an RPC
/// handler, a TaskScope; see corpc/core/this_call.hpp) is stopped at its next await of a Future: once its stop token
/// is stopped, the await completes with CancelledError at once and the awaited future's producer is asked to stop (an
/// RPC is cancelled on its callee); the future itself is not completed, so other holders of it are unaffected. A
/// blocking `wait()` in such work returns the same way.
///
/// Results are handed out by value: `co_await std::move(fut)` (or awaiting the prvalue `rpc_async(...)`) moves the
/// result out when no other copy of the future exists, and copies it otherwise. A move-only result can be taken once.
///
/// The common path — one coroutine awaiting one result — takes no lock and allocates nothing beyond the shared state,
/// which is recycled per thread: the awaiting frame itself is the continuation. `wait()` spins briefly, then sleeps on
/// a futex; it throws UsageError on a corpc I/O thread, where blocking would deadlock.
#pragma once

#include <chrono>
#include <concepts>
#include <exception>
#include <type_traits>
#include <utility>

#include "corpc/core/detail/continuation.hpp"
#include "corpc/core/detail/future_awaiter.hpp"
#include "corpc/core/detail/future_state.hpp"
#include "corpc/core/detail/future_wait.hpp"
#include "corpc/core/errors.hpp"
#include "corpc/core/executor.hpp"

namespace corpc {

/// An eager result: the value, error or cancellation of work already under way (see corpc/core/future.hpp).
/// Copies share one result and may be used from any thread. Await it in a coroutine, `wait()` for it outside one, or
/// chain with `then()`. Every RPC returns one; Promise makes your own. `T` may be void.
template <class T>
class [[nodiscard]] Future {
 public:
  using value_type = T;  ///< The result type (`void` for Future<void>).

  Future() = default;  ///< an invalid future; `valid()` is false
  /// Another handle on the same result.
  Future(const Future& o) noexcept : s_(o.s_) {
    if (s_) s_->add_handle();
  }
  /// Takes over `o`'s handle; `o` becomes invalid.
  Future(Future&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  /// Replaces this handle by `o` (copy or move).
  Future& operator=(Future o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  ~Future() {
    if (s_) s_->release_handle();
  }

  /// False for a default-constructed or moved-from future, on which nothing but assignment is allowed.
  bool valid() const noexcept { return s_ != nullptr; }
  /// True once completed (value, error or cancellation); never blocks.
  bool done() const noexcept { return s_->ready(); }
  /// True if completed with an error (CancelledError included).
  bool has_error() const noexcept { return done() && s_->error() != nullptr; }
  /// The error it completed with; nullptr while pending or after a value.
  std::exception_ptr error() const noexcept { return done() ? s_->error() : nullptr; }
  /// True if it completed with CancelledError (a stop, as opposed to a value or a failure).
  bool cancelled() const noexcept {
    if (!has_error()) return false;
    try {
      std::rethrow_exception(s_->error());
    } catch (const CancelledError&) {
      return true;
    } catch (...) {
      return false;
    }
  }

  /// Asks the work behind this future to stop and completes it — every copy — with CancelledError, unless it has
  /// completed already (then nothing happens). An RPC is cancelled on its callee (see corpc/core/this_call.hpp) and
  /// its reply, if one comes, is dropped. Idempotent; any thread.
  void cancel() const noexcept {
    if (s_) s_->cancel();
  }

  /// The value of a completed future (rethrows its error). Throws UsageError if it is not complete yet.
  T value() const& { return result(false); }
  /// As value(), moving the result out when this is the only handle.
  T value() && { return result(true); }

  /// Blocks the calling thread until complete, then returns the value or rethrows the error. In stoppable work a
  /// stop ends the wait with CancelledError. Throws UsageError on a corpc I/O thread (co_await there instead).
  T wait() const& {
    detail::block_until_ready(s_);
    return result(false);
  }
  /// As wait(), moving the result out when this is the only handle.
  T wait() && {
    detail::block_until_ready(s_);
    return result(true);
  }
  /// As wait(), but throws TimeoutError if the future is not complete after `timeout`.
  template <class Rep, class Period>
  T wait(std::chrono::duration<Rep, Period> timeout) const {
    detail::block_until_ready_for(s_, timeout);
    return result(false);
  }

  /// Calls `fn(value)` (or `fn()` for Future<void>) when this completes and returns a future of its result (a Future
  /// or Task returned by `fn` is not unwrapped). An error in this future, or thrown by `fn`, completes the returned
  /// future with that error; `fn` is skipped then. `fn` runs on the executor current here, else the default one.
  template <class F>
  auto then(F fn) const {
    return detail::then(*this, std::move(fn));
  }

  /// @cond INTERNAL
  using Awaiter = detail::FutureAwaiter<T>;
  /// @endcond
  /// `co_await fut`: suspends until complete (resuming per the rule in corpc/core/executor.hpp), then returns a copy
  /// of the value or rethrows the error. In stoppable work (an RPC handler, a TaskScope) a stop completes the await
  /// with CancelledError and asks the producer to stop, leaving the future itself pending.
  Awaiter operator co_await() const& noexcept { return Awaiter{s_, false}; }
  /// `co_await std::move(fut)`: as above, moving the value out when this is the only handle.
  Awaiter operator co_await() && noexcept { return Awaiter{std::exchange(s_, nullptr), true}; }

 private:
  friend class Promise<T>;
  friend struct detail::FutureAccess;
  explicit Future(detail::FutureState<T>* s) noexcept : s_(s) { s_->add_handle(); }

  T result(bool may_move) const {
    if (!s_->ready()) throw UsageError("Future::value() called before the future completed");
    if constexpr (std::is_void_v<T>) {
      s_->get();
    } else {
      return s_->consume(may_move);
    }
  }

  detail::FutureState<T>* s_ = nullptr;
};

/// The write end of a Future. Move-only; the first completion wins. Destroying an unfulfilled promise fails its
/// future with RpcError("broken promise") so that no waiter hangs.
template <class T>
class Promise {
 public:
  /// A new pending result.
  Promise() : s_(detail::FutureState<T>::make()) {}
  /// Takes over `o`'s result; `o` is left empty (its destructor does nothing).
  Promise(Promise&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  /// Abandons this promise's result (failing it if unfulfilled, as the destructor does), then takes over `o`'s.
  Promise& operator=(Promise&& o) noexcept {
    if (this != &o) {
      abandon();
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  ~Promise() { abandon(); }

  /// A Future of this promise's result; may be called any number of times.
  Future<T> get_future() const { return Future<T>(s_); }

  /// Completes with a T built from `a...` (nothing for void). Continuations registered on the future run now on
  /// this thread or are queued on their executors. False if already completed; an exception thrown by T's
  /// constructor becomes the result's error. Any thread.
  template <class... A>
  bool set_value(A&&... a) {
    return s_->set_value(std::forward<A>(a)...);
  }
  /// Completes with error `e` (`std::current_exception()` in a catch block); false if already completed. Any thread.
  bool set_exception(std::exception_ptr e) noexcept { return s_->set_exception(std::move(e)); }
  /// Completes with the exception object `e`, as `set_exception(std::make_exception_ptr(e))`:
  /// `promise.set_exception(corpc::TimeoutError("..."))`.
  template <class E>
    requires std::derived_from<std::remove_cvref_t<E>, std::exception>
  bool set_exception(E&& e) { return set_exception(std::make_exception_ptr(std::forward<E>(e))); }

 private:
  void abandon() noexcept {
    if (!s_) return;
    if (!s_->ready()) s_->set_exception(std::make_exception_ptr(RpcError("broken promise")));
    s_->release();
    s_ = nullptr;
  }
  detail::FutureState<T>* s_;
};

/// A Future already completed with `v`.
template <class T>
Future<std::decay_t<T>> make_ready_future(T&& v) {
  Promise<std::decay_t<T>> p;
  p.set_value(std::forward<T>(v));
  return p.get_future();
}
/// A Future<void> already completed.
inline Future<void> make_ready_future() {
  Promise<void> p;
  p.set_value();
  return p.get_future();
}
/// A Future already failed with `e`.
template <class T>
Future<T> make_exceptional_future(std::exception_ptr e) {
  Promise<T> p;
  p.set_exception(std::move(e));
  return p.get_future();
}

}  // namespace corpc
