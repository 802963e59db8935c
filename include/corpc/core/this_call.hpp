/// @file
/// What the running coroutine or function may ask about the work it belongs to.
///
/// Inside a function called over RPC (on any thread it runs or resumes on, in any coroutine it awaits):
///
/// ```cpp
///   corpc::Task<int> crunch(int n) {
///     for (int i = 0; i < n; ++i) {
///       if (corpc::this_call::stop_requested()) co_return -1;  // a plain loop polls; ...
///       co_await corpc::rpc_async<&step>("worker2", i);         // ... an await of a corpc future is a stop point
///     }
///     co_return n;
///   }
/// ```
///
/// The stop is requested when the caller cancels the call (Future::cancel, a stop token in CallOptions), when the
/// call's deadline passes on the caller, or when the caller's connection is lost. Once it is requested, every await
/// of a corpc Future in that call completes with CancelledError at once (and cancels what it awaited: a nested RPC is
/// cancelled on its callee in turn), so a coroutine function stops at its next suspension point without polling;
/// a function that computes without awaiting polls `stop_requested()` or registers a std::stop_callback on the token.
/// Whatever the function returns after the stop is dropped: the caller has its outcome already.
///
/// Nested calls inherit what is left of the deadline: an rpc_async issued while handling a call times out no later
/// than the call it serves (CallOptions::timeout can only shorten it).
///
/// Outside any call (main, a thread of your own) the token cannot be stopped and there is no deadline, unless the
/// coroutine runs in a TaskScope (corpc/core/scope.hpp), whose token it then sees.
#pragma once

#include <chrono>
#include <optional>
#include <stop_token>

#include "corpc/core/call_context.hpp"

namespace corpc::this_call {

/// The running work's stop token (stop_possible() is false outside cancellable work).
inline std::stop_token stop_token() noexcept { return current_call_context().stop; }
/// True once the running work was asked to stop (shorthand for `stop_token().stop_requested()`).
inline bool stop_requested() noexcept { return current_call_context().stop.stop_requested(); }

/// When the running call's caller stops waiting for it (its timeout, carried across every hop); nullopt: none.
inline std::optional<std::chrono::steady_clock::time_point> deadline() noexcept {
  const auto d = current_call_context().deadline;
  if (d == std::chrono::steady_clock::time_point::max()) return std::nullopt;
  return d;
}

}  // namespace corpc::this_call
