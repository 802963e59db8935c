// corpc/core/detail/continuation.hpp — callbacks run when a future completes: Future::then, and corpc's own
// inline bookkeeping (internal).
#pragma once

#include <type_traits>
#include <utility>

#include "corpc/core/call_context.hpp"
#include "corpc/core/detail/dispatch.hpp"
#include "corpc/core/detail/future_state.hpp"
#include "corpc/core/executor.hpp"

namespace corpc::detail {

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

// Internal (corpc's own bookkeeping): runs `fn()` once `f` completes, inline on the completing thread, which may be
// an I/O thread: `fn` must be short and must not block.
template <class T, class Fn>
void on_ready_inline(const Future<T>& f, Fn fn) {
  auto* node = new CallbackNode<Fn>(std::move(fn), nullptr);
  if (!state_of(f)->add_waiter(node)) node->notify(node);
}

template <class F, class T>
struct ThenResult {
  using type = std::invoke_result_t<F, Stored<T>>;
};
template <class F>
struct ThenResult<F, void> {
  using type = std::invoke_result_t<F>;
};

// Future<T>::then: `fn` on `src`'s value, on the executor where `then` was called; an error in `src` or thrown by
// `fn` completes the returned future instead.
template <class T, class F>
auto then(const Future<T>& src, F fn) {
  using U = typename ThenResult<F, T>::type;
  Promise<U> next;
  Future<U> out = next.get_future();
  auto body = [src, fn = std::move(fn), next = std::move(next)]() mutable {
    try {
      if constexpr (std::is_void_v<T>) {
        state_of(src)->get();
        if constexpr (std::is_void_v<U>) {
          fn();
          next.set_value();
        } else {
          next.set_value(fn());
        }
      } else {
        if constexpr (std::is_void_v<U>) {
          fn(state_of(src)->get());
          next.set_value();
        } else {
          next.set_value(fn(state_of(src)->get()));
        }
      }
    } catch (...) {
      next.set_exception(std::current_exception());
    }
  };
  auto* node = new CallbackNode<decltype(body)>(std::move(body), resumption_executor());
  if (!state_of(src)->add_waiter(node)) node->notify(node);
  return out;
}

}  // namespace corpc::detail
