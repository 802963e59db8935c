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
/// wait_all cancels its inputs) and completes the future — every copy — with CancelledError unless it completed
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

#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <exception>
#include <new>
#include <memory>
#include <optional>
#include <stop_token>
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

// Something to notify when a state completes: an awaiting coroutine, a blocked thread, a `then` node.
struct Waiter {
  Waiter* next = nullptr;
  void (*notify)(Waiter*) noexcept = nullptr;
};

// Recycles blocks of one size per thread, so that steady-state calls take no trip to the heap. A block freed on
// another thread (a reply completes on an I/O thread, the caller drops the future on its own) goes back to the cache
// of the thread that allocated it, through a lock-free list that the owner drains when its own list is empty.
//
// Lifetime: a cache outlives its thread while blocks it issued are still alive elsewhere. At thread exit the owner
// closes the remote list (one atomic exchange, so no block can be pushed after the last drain), frees what it holds,
// and hands the count of blocks still out to `outstanding`; each of those, freed later on another thread, finds the
// list closed, frees itself and counts down; whoever brings the count to zero deletes the cache. Nothing leaks, and
// the fast paths (allocate and free on the owner thread) stay free of atomic read-modify-writes.
template <std::size_t Size>
class BlockCache {
  struct Cache;
  struct alignas(16) Header {
    Cache* owner;  // null: allocated after its thread's cache was closed, freed straight to the heap
    Header* next;
  };

 public:
  static void* allocate() {
    Cache* c = local();
    Header* h;
    if (c && !c->count) c->drain_remote();
    if (c && c->count) {
      h = c->blocks[--c->count];
    } else {
      h = static_cast<Header*>(::operator new(sizeof(Header) + Size));
      h->owner = c;
      if (c) ++c->issued;
    }
    return h + 1;
  }
  static void deallocate(void* p) noexcept {
    Header* h = static_cast<Header*>(p) - 1;
    Cache* owner = h->owner;
    if (!owner) return ::operator delete(h);
    if (owner == tls_cache) {
      if (owner->count < kKeep) return void(owner->blocks[owner->count++] = h);
      --owner->issued;
      return ::operator delete(h);
    }
    Header* head = owner->remote.load(std::memory_order_relaxed);
    do {
      if (head == closed()) {
        ::operator delete(h);
        return owner->release(1);
      }
      h->next = head;
    } while (!owner->remote.compare_exchange_weak(head, h, std::memory_order_release, std::memory_order_relaxed));
  }

 private:
  static constexpr std::size_t kKeep = 256;
  static Header* closed() noexcept { return reinterpret_cast<Header*>(alignof(Header)); }  // never a real block
  struct Cache {
    Header* blocks[kKeep];
    std::size_t count = 0;
    std::size_t issued = 0;  // blocks this cache made and the owner has not given back to the heap (owner only)
    std::atomic<Header*> remote{nullptr};
    std::atomic<std::ptrdiff_t> outstanding{0};
    void take(Header* list) noexcept {
      for (Header* h = list; h;) {
        Header* next = h->next;
        if (count < kKeep) {
          blocks[count++] = h;
        } else {
          --issued;
          ::operator delete(h);
        }
        h = next;
      }
    }
    void drain_remote() noexcept { take(remote.exchange(nullptr, std::memory_order_acquire)); }
    // Counts `n` blocks as given back; the last one deletes the cache (see the lifetime note above).
    void release(std::ptrdiff_t n) noexcept {
      if (outstanding.fetch_sub(n, std::memory_order_acq_rel) == n) delete this;
    }
    void close() noexcept {
      take(remote.exchange(closed(), std::memory_order_acquire));
      while (count) {
        --issued;
        ::operator delete(blocks[--count]);
      }
      // `outstanding` went negative by the blocks freed elsewhere meanwhile; adding what is still out (plus this
      // call's own count, released at once) balances it.
      outstanding.fetch_add(static_cast<std::ptrdiff_t>(issued) + 1, std::memory_order_acq_rel);
      release(1);
    }
  };
  struct Guard {
    Cache* cache = new Cache;
    ~Guard() {
      tls_cache = nullptr;
      tls_closed = true;
      cache->close();
    }
  };
  static inline thread_local Cache* tls_cache = nullptr;
  static inline thread_local bool tls_closed = false;  // this thread's guard is gone: use the heap directly
  static Cache* local() {
    if (!tls_cache && !tls_closed) {
      static thread_local Guard guard;
      tls_cache = guard.cache;
    }
    return tls_cache;
  }
};

// Inline resumption nests on the stack; past this depth, continuations are queued instead.
inline thread_local int tls_inline_depth = 0;
inline constexpr int kMaxInlineDepth = 16;

// Runs `item` on `ex`: inline when `ex` is null or already drives this thread (bounded nesting), queued otherwise.
inline void dispatch(Executor* ex, WorkItem* item) noexcept {
  if (!ex || (ex->running_here() && tls_inline_depth < kMaxInlineDepth)) {
    ++tls_inline_depth;
    item->run(item);
    --tls_inline_depth;
  } else {
    ex->enqueue(item);
  }
}

// How a future asks its producer to stop. The producer arms a hook once; the first cancel request runs it (at once, or
// when the hook is armed if the request came first). The hook must be short and must not block; `keep` holds what
// it needs alive for as long as the state lives (it must not reference the state itself).
struct CancelHook {
  void (*fn)(const CancelHook&) noexcept = nullptr;
  std::shared_ptr<void> keep;
  void* p = nullptr;
  std::uint64_t a = 0, b = 0;
};
class CancelSlot {
 public:
  void arm_cancel(CancelHook h) noexcept {
    hook_ = std::move(h);
    std::uint8_t s = kIdle;
    if (!cancel_state_.compare_exchange_strong(s, kArmed, std::memory_order_acq_rel)) hook_.fn(hook_);  // requested
  }
  // True for the first request only.
  bool request_cancel() noexcept {
    const std::uint8_t old = cancel_state_.exchange(kRequested, std::memory_order_acq_rel);
    if (old == kArmed) hook_.fn(hook_);
    return old != kRequested;
  }

 private:
  static constexpr std::uint8_t kIdle = 0, kArmed = 1, kRequested = 2;
  std::atomic<std::uint8_t> cancel_state_{kIdle};
  CancelHook hook_;
};

inline std::exception_ptr cancelled_error() { return std::make_exception_ptr(CancelledError()); }

template <class T>
class FutureState : public CancelSlot {
 public:
  static FutureState* make() { return new (BlockCache<sizeof(FutureState)>::allocate()) FutureState; }

  void add_ref() noexcept { refs_.fetch_add(1, std::memory_order_relaxed); }
  void release() noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      this->~FutureState();
      BlockCache<sizeof(FutureState)>::deallocate(this);
    }
  }
  // Future handles (consumers), as opposed to promises and internal references: a result is moved out only when
  // exactly one consumer exists.
  void add_handle() noexcept {
    add_ref();
    handles_.fetch_add(1, std::memory_order_relaxed);
  }
  void release_handle() noexcept {
    handles_.fetch_sub(1, std::memory_order_relaxed);
    release();
  }
  bool sole_handle() const noexcept { return handles_.load(std::memory_order_acquire) == 1; }

  bool ready() const noexcept { return head_.load(std::memory_order_acquire) == kReady; }

  // Asks the producer to stop, then completes as cancelled unless the producer (or anything else) completed first.
  void cancel() noexcept {
    if (ready()) return;
    add_ref();  // the hook may complete this state, dropping the producer's reference
    request_cancel();
    if (!ready()) set_exception(cancelled_error());
    release();
  }

  // First completion wins; returns false if the state was already completed (or being completed).
  template <class... A>
  bool set_value(A&&... a) {
    if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
    try {
      value_.emplace(std::forward<A>(a)...);
    } catch (...) {
      error_ = std::current_exception();
    }
    publish();
    return true;
  }
  bool set_exception(std::exception_ptr e) noexcept {
    if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
    error_ = std::move(e);
    publish();
    return true;
  }

  // Registers `w` to be notified on completion. False if the state is complete already: `w` is not registered and
  // the caller proceeds at once.
  bool add_waiter(Waiter* w) noexcept {
    std::uintptr_t head = head_.load(std::memory_order_acquire);
    do {
      if (head == kReady) return false;
      w->next = reinterpret_cast<Waiter*>(head);
    } while (!head_.compare_exchange_weak(head, reinterpret_cast<std::uintptr_t>(w), std::memory_order_acq_rel,
                                          std::memory_order_acquire));
    return true;
  }

  // Preconditions for the accessors: ready().
  std::exception_ptr error() const noexcept { return error_; }
  const Stored<T>& get() const {
    if (error_) std::rethrow_exception(error_);
    return *value_;
  }
  Stored<T>&& take() {
    if (error_) std::rethrow_exception(error_);
    return std::move(*value_);
  }
  // The value for one consumer: moved when it is the only one (or when T cannot be copied), copied otherwise.
  Stored<T> consume(bool may_move) {
    if constexpr (std::is_copy_constructible_v<Stored<T>>) {
      if (!may_move || !sole_handle()) return get();
    }
    return take();
  }

 private:
  static constexpr std::uintptr_t kReady = 1;

  void publish() noexcept {
    std::uintptr_t head = head_.exchange(kReady, std::memory_order_acq_rel);
    // The list is newest-first; notify in registration order.
    Waiter* fifo = nullptr;
    for (auto* w = reinterpret_cast<Waiter*>(head); w;) {
      Waiter* next = w->next;
      w->next = fifo;
      fifo = w;
      w = next;
    }
    while (fifo) {
      Waiter* next = fifo->next;  // read first: notify may end the waiter's life
      fifo->notify(fifo);
      fifo = next;
    }
  }

  std::atomic<std::uint32_t> refs_{1};
  std::atomic<std::uint32_t> handles_{0};
  std::atomic<bool> claimed_{false};
  std::atomic<std::uintptr_t> head_{0};  // 0: pending; kReady; or the newest Waiter*
  std::exception_ptr error_;
  std::optional<Stored<T>> value_;
};

// A thread blocked in wait(): the waiter lives on its stack.
struct BlockingWaiter : Waiter {
  Event event;
  BlockingWaiter() { notify = [](Waiter* w) noexcept { static_cast<BlockingWaiter*>(w)->event.set(); }; }
};

// A thread blocked in wait(timeout): may give up before completion, so the node is shared with the state.
struct TimedWaiter : Waiter {
  Event event;
  std::atomic<int> refs{2};
  TimedWaiter() {
    notify = [](Waiter* w) noexcept {
      auto* self = static_cast<TimedWaiter*>(w);
      self->event.set();
      self->release();
    };
  }
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};

// Runs `fn` once a state completes, on `ex` (inline when null), restoring the registrant's CallContext around it.
template <class Fn>
struct CallbackNode : Waiter, WorkItem {
  Fn fn;
  Executor* ex;
  CallContext ctx;
  CallbackNode(Fn f, Executor* e) : fn(std::move(f)), ex(e), ctx(current_call_context()) {
    notify = [](Waiter* w) noexcept {
      auto* self = static_cast<CallbackNode*>(w);
      dispatch(self->ex, static_cast<WorkItem*>(self));
    };
    run = [](WorkItem* w) noexcept {
      auto* self = static_cast<CallbackNode*>(w);
      {
        CallContextScope scope(self->ctx);
        try {
          self->fn();
        } catch (...) {
          // Callbacks report their own errors (through the futures they complete).
        }
      }
      delete self;
    };
  }
};

// An await in stoppable work. The waiter node lives on the heap, shared by the state and the awaiter, so that a stop
// can resume the coroutine before the state completes (the node stays in the state's list until then). The stop
// asks the awaited future's producer to stop (an RPC is cancelled on its callee) but never completes the state
// itself: other holders of a shared future (an RRef's readiness) are unaffected.
struct StoppableWait : Waiter {
  static constexpr int kSetup = 0, kWaiting = 1, kCompleted = 2, kStopped = 3;
  std::atomic<int> st{kSetup};
  std::atomic<int> refs{2};  // the state's list, the awaiter
  WorkItem* resume = nullptr;
  Executor* ex = nullptr;
  CancelSlot* producer = nullptr;
  StoppableWait() {
    notify = [](Waiter* w) noexcept {
      auto* self = static_cast<StoppableWait*>(w);
      int expected = kWaiting;
      if (self->st.compare_exchange_strong(expected, kCompleted, std::memory_order_acq_rel)) {
        dispatch(self->ex, self->resume);
      } else if (expected == kSetup) {
        self->st.compare_exchange_strong(expected, kCompleted, std::memory_order_acq_rel);  // await_suspend sees it
      }
      self->release();
    };
  }
  void release() noexcept {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
  // The stop callback.
  void operator()() noexcept {
    int expected = kWaiting;
    if (st.compare_exchange_strong(expected, kStopped, std::memory_order_acq_rel)) {
      producer->request_cancel();
      dispatch(ex, resume);
    } else if (expected == kSetup) {
      st.compare_exchange_strong(expected, kStopped, std::memory_order_acq_rel);
    }
  }
};
struct StopWaitCallback {
  StoppableWait* w;
  void operator()() const noexcept { (*w)(); }
};

template <class F, class T>
struct ThenResult {
  using type = std::invoke_result_t<F, Stored<T>>;
};
template <class F>
struct ThenResult<F, void> {
  using type = std::invoke_result_t<F>;
};

template <class T>
FutureState<T>* state_of(const Future<T>& f) noexcept;
// A Future handle on `s` (for code that completes the state itself, such as an RPC's reply path).
template <class T>
Future<T> future_of(FutureState<T>* s) noexcept;

// Internal (corpc's own bookkeeping): runs `fn()` once `f` completes, inline on the completing thread, which may be
// an I/O thread: `fn` must be short and must not block.
template <class T, class Fn>
void on_ready_inline(const Future<T>& f, Fn fn) {
  auto* node = new CallbackNode<Fn>(std::move(fn), nullptr);
  if (!state_of(f)->add_waiter(node)) node->notify(node);
}

}  // namespace detail

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

  /// Blocks the calling thread until complete, then returns the value or rethrows the error.
  /// Throws UsageError on a corpc I/O thread (co_await there instead).
  T wait() const& {
    block();
    return result(false);
  }
  /// As wait(), moving the result out when this is the only handle.
  T wait() && {
    block();
    return result(true);
  }
  /// As wait(), but throws TimeoutError if the future is not complete after `timeout`.
  template <class Rep, class Period>
  T wait(std::chrono::duration<Rep, Period> timeout) const {
    if (!s_->ready()) {
      check_may_block("Future::wait");
      auto* w = new detail::TimedWaiter;
      if (!s_->add_waiter(w)) {
        w->release();
        w->release();
      } else {
        const bool ok = w->event.wait_until(std::chrono::steady_clock::now() + timeout);
        w->release();
        if (!ok) throw TimeoutError("Future::wait timed out");
      }
    }
    return result(false);
  }

  /// Calls `fn(value)` (or `fn()` for Future<void>) when this completes and returns a future of its result (a Future
  /// or Task returned by `fn` is not unwrapped). An error in this future, or thrown by `fn`, completes the returned
  /// future with that error; `fn` is skipped then. `fn` runs on the executor current here, else the default one.
  template <class F>
  auto then(F fn) const {
    using U = typename detail::ThenResult<F, T>::type;
    Promise<U> next;
    Future<U> out = next.get_future();
    auto body = [src = *this, fn = std::move(fn), next = std::move(next)]() mutable {
      try {
        if constexpr (std::is_void_v<T>) {
          src.s_->get();
          if constexpr (std::is_void_v<U>) {
            fn();
            next.set_value();
          } else {
            next.set_value(fn());
          }
        } else {
          if constexpr (std::is_void_v<U>) {
            fn(src.s_->get());
            next.set_value();
          } else {
            next.set_value(fn(src.s_->get()));
          }
        }
      } catch (...) {
        next.set_exception(std::current_exception());
      }
    };
    auto* node = new detail::CallbackNode<decltype(body)>(std::move(body), resumption_executor());
    if (!s_->add_waiter(node)) node->notify(node);
    return out;
  }

  /// @cond INTERNAL
  // Awaiting: the awaiter lives in the coroutine frame and is itself the continuation (no allocation, no lock).
  class Awaiter : detail::Waiter, WorkItem {
   public:
    Awaiter(detail::FutureState<T>* s, bool owns) noexcept : s_(s), owns_(owns) {}
    Awaiter(const Awaiter&) = delete;
    ~Awaiter() {
      stop_.reset();
      if (node_) node_->release();
      if (owns_) s_->release_handle();
    }
    bool await_ready() const noexcept { return s_->ready(); }
    bool await_suspend(std::coroutine_handle<> h) noexcept {
      h_ = h;
      ex_ = resumption_executor();
      ctx_ = current_call_context();
      run = [](WorkItem* w) noexcept {
        auto* self = static_cast<Awaiter*>(w);
        CallContextScope scope(self->ctx_);  // the coroutine's context while it runs; the resumer's afterwards
        self->h_.resume();
      };
      if (ctx_.stop.stop_possible()) return suspend_stoppable();
      notify = [](detail::Waiter* w) noexcept {
        auto* self = static_cast<Awaiter*>(w);
        detail::dispatch(self->ex_, static_cast<WorkItem*>(self));
      };
      run = [](WorkItem* w) noexcept {
        auto* self = static_cast<Awaiter*>(w);
        CallContextScope scope(self->ctx_);  // the coroutine's context while it runs; the resumer's afterwards
        self->h_.resume();
      };
      return s_->add_waiter(this);
    }
    T await_resume() {
      if (node_) {
        stop_.reset();  // waits for a stop callback running elsewhere
        const bool stopped = node_->st.load(std::memory_order_acquire) == detail::StoppableWait::kStopped;
        std::exchange(node_, nullptr)->release();
        if (stopped) throw CancelledError();
      }
      if constexpr (std::is_void_v<T>) {
        s_->get();
      } else {
        return s_->consume(owns_);
      }
    }

   private:
    detail::FutureState<T>* s_;
    bool owns_;  // awaited as an rvalue: holds the handle and may move the result out
    std::coroutine_handle<> h_;
    Executor* ex_ = nullptr;
    CallContext ctx_;
    detail::StoppableWait* node_ = nullptr;
    std::optional<std::stop_callback<detail::StopWaitCallback>> stop_;

    // In stoppable work: resumes on completion or on a stop, whichever comes first (see StoppableWait).
    bool suspend_stoppable() noexcept {
      using W = detail::StoppableWait;
      node_ = new W;
      node_->resume = static_cast<WorkItem*>(this);
      node_->ex = ex_;
      node_->producer = s_;
      stop_.emplace(ctx_.stop, detail::StopWaitCallback{node_});  // a stop requested already claims the node now
      if (!s_->add_waiter(node_)) {
        node_->release();  // the list's reference: never added
        int expected = W::kSetup;
        node_->st.compare_exchange_strong(expected, W::kCompleted, std::memory_order_acq_rel);
        return false;
      }
      int expected = W::kSetup;
      return node_->st.compare_exchange_strong(expected, W::kWaiting, std::memory_order_acq_rel);
    }
  };
  /// @endcond
  /// `co_await fut`: suspends until complete (resuming per the rule in corpc/core/executor.hpp), then returns a copy
  /// of the value or rethrows the error. In stoppable work (an RPC handler, a TaskScope) a stop completes the await
  /// with CancelledError and asks the producer to stop, leaving the future itself pending.
  Awaiter operator co_await() const& noexcept { return Awaiter{s_, false}; }
  /// `co_await std::move(fut)`: as above, moving the value out when this is the only handle.
  Awaiter operator co_await() && noexcept { return Awaiter{std::exchange(s_, nullptr), true}; }

 private:
  friend class Promise<T>;
  friend detail::FutureState<T>* detail::state_of<T>(const Future<T>&) noexcept;
  friend Future<T> detail::future_of<T>(detail::FutureState<T>*) noexcept;
  template <class>
  friend class Future;
  explicit Future(detail::FutureState<T>* s) noexcept : s_(s) { s_->add_handle(); }

  void block() const {
    if (s_->ready()) return;
    check_may_block("Future::wait");
    if (auto& token = current_call_context().stop; token.stop_possible()) {
      // In stoppable work: a stop asks the producer to stop and wakes this thread, which then throws.
      auto* w = new detail::TimedWaiter;
      if (!s_->add_waiter(w)) {
        w->release();
        w->release();
        return;
      }
      {
        auto wake = [w, s = s_]() noexcept {
          s->request_cancel();
          w->event.set();
        };
        std::stop_callback<decltype(wake)> on_stop(token, wake);
        w->event.wait();
      }
      w->release();
      if (!s_->ready()) throw CancelledError();
      return;
    }
    detail::BlockingWaiter w;
    if (s_->add_waiter(&w)) w.event.wait();
  }
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

namespace detail {
template <class T>
FutureState<T>* state_of(const Future<T>& f) noexcept {
  return f.s_;
}
template <class T>
Future<T> future_of(FutureState<T>* s) noexcept {
  return Future<T>(s);
}
}  // namespace detail

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
  /// Completes with error `e`; false if already completed. Any thread.
  bool set_exception(std::exception_ptr e) noexcept { return s_->set_exception(std::move(e)); }
  /// Completes with the exception object `e` (e.g. `promise.set_error(corpc::TimeoutError("..."))`).
  template <class E>
  bool set_error(E e) {
    return set_exception(std::make_exception_ptr(std::move(e)));
  }

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
