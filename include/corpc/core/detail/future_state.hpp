// corpc/core/detail/future_state.hpp — the shared state behind Future<T> and Promise<T>: reference counts, the
// first-completion-wins result, and the lock-free list of waiters to notify (internal).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>
#include <variant>

#include "corpc/core/detail/block_cache.hpp"
#include "corpc/core/detail/cancel_slot.hpp"
#include "corpc/core/errors.hpp"

namespace corpc {
template <class T>
class Future;
template <class T>
class Promise;
}  // namespace corpc

namespace corpc::detail {

// void results are stored as an empty struct so that one implementation serves every T.
template <class T>
using Stored = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// Something to notify when a state completes: an awaiting coroutine, a blocked thread, a `then` node. Each kind of
// waiter embeds this node, so the state's list allocates nothing of its own.
struct Waiter {
  Waiter* next = nullptr;
  void (*notify)(Waiter*) noexcept = nullptr;
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

// The one way into a Future's state from outside the class (Future befriends it), so that the public header need
// not name each internal user.
struct FutureAccess {
  template <class T>
  static FutureState<T>* state(const Future<T>& f) noexcept {
    return f.s_;
  }
  template <class T>
  static Future<T> adopt(FutureState<T>* s) noexcept {
    return Future<T>(s);
  }
};

// The state behind `f` (null for an invalid future).
template <class T>
FutureState<T>* state_of(const Future<T>& f) noexcept {
  return FutureAccess::state(f);
}
// A Future handle on `s` (for code that completes the state itself, such as an RPC's reply path).
template <class T>
Future<T> future_of(FutureState<T>* s) noexcept {
  return FutureAccess::adopt(s);
}

}  // namespace corpc::detail
