// corpc/core/detail/future_awaiter.hpp — `co_await fut`: the awaiter that is itself the continuation, and the
// stoppable variant used in cancellable work (internal).
#pragma once

#include <atomic>
#include <coroutine>
#include <optional>
#include <stop_token>
#include <type_traits>
#include <utility>

#include "corpc/core/call_context.hpp"
#include "corpc/core/detail/cancel_slot.hpp"
#include "corpc/core/detail/dispatch.hpp"
#include "corpc/core/detail/future_state.hpp"
#include "corpc/core/errors.hpp"
#include "corpc/core/executor.hpp"

namespace corpc::detail {

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

// Future<T>::Awaiter. It lives in the coroutine frame and is itself the continuation: the common await (not in
// stoppable work) takes no lock and allocates nothing. It resumes the coroutine on the executor current where it
// suspended (resumption_executor), with the coroutine's CallContext restored.
template <class T>
class FutureAwaiter : Waiter, WorkItem {
 public:
  // `owns`: awaited as an rvalue; the awaiter holds the handle and may move the result out.
  FutureAwaiter(FutureState<T>* s, bool owns) noexcept : s_(s), owns_(owns) {}
  FutureAwaiter(const FutureAwaiter&) = delete;
  ~FutureAwaiter() {
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
      auto* self = static_cast<FutureAwaiter*>(w);
      CallContextScope scope(self->ctx_);  // the coroutine's context while it runs; the resumer's afterwards
      self->h_.resume();
    };
    if (ctx_.stop.stop_possible()) return suspend_stoppable();
    notify = [](Waiter* w) noexcept {
      auto* self = static_cast<FutureAwaiter*>(w);
      dispatch(self->ex_, static_cast<WorkItem*>(self));
    };
    return s_->add_waiter(this);
  }
  T await_resume() {
    if (node_) {
      stop_.reset();  // waits for a stop callback running elsewhere
      const bool stopped = node_->st.load(std::memory_order_acquire) == StoppableWait::kStopped;
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
  FutureState<T>* s_;
  bool owns_;
  std::coroutine_handle<> h_;
  Executor* ex_ = nullptr;
  CallContext ctx_;
  StoppableWait* node_ = nullptr;
  std::optional<std::stop_callback<StopWaitCallback>> stop_;

  // In stoppable work: resumes on completion or on a stop, whichever comes first (see StoppableWait).
  bool suspend_stoppable() noexcept {
    node_ = new StoppableWait;
    node_->resume = static_cast<WorkItem*>(this);
    node_->ex = ex_;
    node_->producer = s_;
    stop_.emplace(ctx_.stop, StopWaitCallback{node_});  // a stop requested already claims the node now
    if (!s_->add_waiter(node_)) {
      node_->release();  // the list's reference: never added
      int expected = StoppableWait::kSetup;
      node_->st.compare_exchange_strong(expected, StoppableWait::kCompleted, std::memory_order_acq_rel);
      return false;
    }
    int expected = StoppableWait::kSetup;
    return node_->st.compare_exchange_strong(expected, StoppableWait::kWaiting, std::memory_order_acq_rel);
  }
};

}  // namespace corpc::detail
