// corpc/core/detail/future_wait.hpp — blocking a thread until a future's state completes: Future::wait (internal).
#pragma once

#include <atomic>
#include <chrono>
#include <stop_token>

#include "corpc/core/call_context.hpp"
#include "corpc/core/detail/event.hpp"
#include "corpc/core/detail/future_state.hpp"
#include "corpc/core/errors.hpp"
#include "corpc/core/executor.hpp"

namespace corpc::detail {

// A thread blocked in wait(): the waiter lives on its stack.
struct BlockingWaiter : Waiter {
  Event event;
  BlockingWaiter() {
    notify = [](Waiter* w) noexcept { static_cast<BlockingWaiter*>(w)->event.set(); };
  }
};

// A thread blocked in wait(timeout), or in stoppable work: may give up before completion, so the node is shared with
// the state (one reference each).
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

// Returns once `s` has completed (Future::wait). Throws UsageError on a thread that must not block. In stoppable work
// (see corpc/core/this_call.hpp) a stop asks the producer to stop and wakes the thread, which then throws
// CancelledError, leaving the state pending.
template <class T>
void block_until_ready(FutureState<T>* s) {
  if (s->ready()) return;
  check_may_block("Future::wait");
  if (auto& token = current_call_context().stop; token.stop_possible()) {
    auto* w = new TimedWaiter;
    if (!s->add_waiter(w)) {
      w->release();
      w->release();
      return;
    }
    {
      auto wake = [w, s]() noexcept {
        s->request_cancel();
        w->event.set();
      };
      std::stop_callback<decltype(wake)> on_stop(token, wake);
      w->event.wait();
    }
    w->release();
    if (!s->ready()) throw CancelledError();
    return;
  }
  BlockingWaiter w;
  if (s->add_waiter(&w)) w.event.wait();
}

// Returns once `s` has completed, or throws TimeoutError after `timeout` (Future::wait(timeout)); UsageError on a
// thread that must not block. The timeout, not a stop, ends this wait.
template <class T, class Rep, class Period>
void block_until_ready_for(FutureState<T>* s, std::chrono::duration<Rep, Period> timeout) {
  if (s->ready()) return;
  check_may_block("Future::wait");
  auto* w = new TimedWaiter;
  if (!s->add_waiter(w)) {
    w->release();
    w->release();
    return;
  }
  const bool ok = w->event.wait_until(std::chrono::steady_clock::now() + timeout);
  w->release();
  if (!ok) throw TimeoutError("Future::wait timed out");
}

}  // namespace corpc::detail
