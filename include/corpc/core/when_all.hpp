/// @file
/// Joining many futures.
///
/// ```
///   when_all(futs)    -> Future<std::vector<T>>: all values in order; fails with the first error to occur, at once.
///   when_all(futs, WhenAll::stop_rest_on_failure): the same, and asks the producers of the inputs still running to
///                        stop when one fails (RPCs are cancelled on their callees), so a failed batch stops working.
///   collect_all(futs) -> Future<std::vector<Future<T>>>: completes when every input has, never fails; inspect each.
/// ```
///
/// Both return at once with an eager Future, which can be awaited (`co_await when_all(std::move(futs))`) or waited on
/// (`when_all(futs).wait()`). Cancelling the future when_all returns asks the producers of its inputs to stop (the
/// inputs themselves, which may be shared, are completed only by their producers: an RPC completes as cancelled).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "corpc/core/future.hpp"

namespace corpc {

/// What when_all does with the other inputs when one fails.
enum class WhenAll : std::uint8_t {
  keep_rest_running,     ///< default: a failure completes the join; the other inputs run on
  stop_rest_on_failure,  ///< a failure also cancels every input still running
};

namespace detail {
// Cancelling a join cancels its inputs (kept alive by the join's state, which they never reference).
template <class T>
void arm_cancel_inputs(CancelSlot& out, std::shared_ptr<std::vector<Future<T>>> inputs) {
  CancelHook h;
  h.fn = [](const CancelHook& self) noexcept {
    for (auto& in : *static_cast<std::vector<Future<T>>*>(self.keep.get())) state_of(in)->request_cancel();
  };
  h.keep = std::move(inputs);
  out.arm_cancel(std::move(h));
}
}  // namespace detail

/// The values of all `futures`, in order (Future<void> for void inputs); fails with the first error to occur, at
/// once, without waiting for the others (which `mode` may cancel). Completes on the thread that completes its last
/// input (or its first failure); continuations follow the usual resumption rule. Empty input: completes at once.
/// Cancelling the returned future cancels the inputs.
template <class T>
Future<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>> when_all(
    std::vector<Future<T>> futures, WhenAll mode = WhenAll::keep_rest_running) {
  using Out = std::conditional_t<std::is_void_v<T>, void, std::vector<T>>;
  struct Join {
    std::shared_ptr<std::vector<Future<T>>> inputs;
    std::atomic<std::size_t> remaining;
    Promise<Out> promise;
    WhenAll mode;
  };
  auto join = std::make_shared<Join>();
  join->remaining = futures.size();
  join->inputs = std::make_shared<std::vector<Future<T>>>(std::move(futures));
  join->mode = mode;
  Future<Out> out = join->promise.get_future();
  if (join->inputs->empty()) {
    if constexpr (std::is_void_v<T>) join->promise.set_value();
    else join->promise.set_value(Out{});
    return out;
  }
  detail::arm_cancel_inputs(*detail::state_of(out), join->inputs);
  for (auto& f : *join->inputs) {
    detail::on_ready_inline(f, [join, f] {
      if (auto e = f.error()) {
        // First error wins; later completions are ignored.
        if (join->promise.set_exception(e) && join->mode == WhenAll::stop_rest_on_failure) {
          for (auto& in : *join->inputs) detail::state_of(in)->request_cancel();
        }
        return;
      }
      if (join->remaining.fetch_sub(1) != 1) return;
      if constexpr (std::is_void_v<T>) {
        join->promise.set_value();
      } else {
        std::vector<T> values;
        values.reserve(join->inputs->size());
        for (auto& in : *join->inputs) values.push_back(in.value());
        join->promise.set_value(std::move(values));
      }
    });
  }
  return out;
}

/// Deprecated (removed in the next release): use WhenAll.
using WaitAll [[deprecated("use WhenAll")]] = WhenAll;
/// Deprecated (removed in the next release): use when_all, the same join under a name that does not read as a
/// blocking wait (it returns a Future).
template <class T>
[[deprecated("use when_all")]] auto wait_all(std::vector<Future<T>> futures,
                                             WhenAll mode = WhenAll::keep_rest_running) {
  return when_all(std::move(futures), mode);
}

/// Completes when every input has completed, whatever the outcome, and never fails: inspect each returned future
/// (`value()`, `has_error()`, `cancelled()`). Empty input: completes at once.
template <class T>
Future<std::vector<Future<T>>> collect_all(std::vector<Future<T>> futures) {
  struct Join {
    std::vector<Future<T>> inputs;
    std::atomic<std::size_t> remaining;
    Promise<std::vector<Future<T>>> promise;
  };
  auto join = std::make_shared<Join>();
  join->remaining = futures.size();
  join->inputs = std::move(futures);
  auto out = join->promise.get_future();
  if (join->inputs.empty()) {
    join->promise.set_value(std::vector<Future<T>>{});
    return out;
  }
  for (auto& f : join->inputs) {
    detail::on_ready_inline(f, [join] {
      if (join->remaining.fetch_sub(1) == 1) join->promise.set_value(join->inputs);
    });
  }
  return out;
}

}  // namespace corpc
