/// @file
/// `rpc_async`, `rpc_sync`: calling a function on another worker.
///
/// ```cpp
///   int add(int a, int b);
///   corpc::Future<int> f = corpc::rpc_async<&add>("worker1", 1, 2);   // eager: the request is on its way
///   int three = co_await f;                                             // or f.wait() outside a coroutine
///   int same = corpc::rpc_sync<&add>(1, 1, 2);                          // by rank, blocking
///   auto g = corpc::rpc_async<&add>("worker1", corpc::with_timeout(100ms), 1, 2);
/// ```
///
/// Arguments are converted to the function's parameter types at the call site, so a mismatch is a compile error.
/// The function may be a plain function, or return Task<T> / Future<T>: the callee then holds no thread while it waits
/// (what PyTorch calls `@async_execution`), and the caller receives T.
/// Errors arrive on the future: RemoteError (the function threw), TimeoutError, ConnectionError, UnknownWorkerError,
/// UnknownFunctionError, ArgumentTypeError. A cancelled call (`f.cancel()`, or a stop token in CallOptions:
/// `rpc_async<&f>("worker1", corpc::with_stop_token(source.get_token()), ...)`) completes with CancelledError, and
/// the callee's function sees its stop requested (corpc/core/this_call.hpp).
#pragma once

#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "corpc/core/future.hpp"
#include "corpc/rpc/detail/call.hpp"
#include "corpc/rpc/options.hpp"
#include "corpc/rpc/worker_info.hpp"

namespace corpc {

/// Registers F under an explicit name, for callers built from other sources (they call by name). Calls naming F
/// itself (`rpc_async<&f>`) need no registration: every binary that mentions them has F registered.
template <auto F>
void register_function(std::string name, Execution execution = execution_of<F>) {
  detail::global_registry().add(detail::make_entry<F>(std::move(name), execution));
}

/// Calls `F(args...)` on worker `to` (a name or a rank) and returns the Future of its result at once: the request is
/// on its way, or waits behind RpcOptions::max_calls_in_flight_per_peer (only a caller on a thread without a corpc
/// executor blocks here then). F is a function pointer constant (`&f`); if it returns Task<T> or Future<T>, the
/// result is T. `args` are converted to F's parameter types here (a mismatch does not compile) and encoded with their
/// Codecs before this returns, so they may be destroyed at once.
///
/// Never throws: every failure completes the future, with RemoteError (F threw), TimeoutError, ConnectionError,
/// UnknownWorkerError, UnknownFunctionError, ArgumentTypeError, MessageTooLargeError, ShutdownError (no runtime),
/// or CancelledError after `cancel()`. On the callee F runs on the worker pool, or on the I/O thread for
/// Execution::io_thread functions. Any thread may call it.
template <auto F, class... A>
  requires(!detail::first_is_options<A...>)
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, A&&... args) {
  return detail::call_function<F>(to, CallOptions{}, false, std::forward<A>(args)...);
}

/// As rpc_async(to, args...), with per-call options: a timeout (with_timeout) or a stop token (with_stop_token).
template <auto F, class... A>
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, const CallOptions& options, A&&... args) {
  return detail::call_function<F>(to, options, false, std::forward<A>(args)...);
}

/// `rpc_async<F>(to, args...).wait()`: blocks the calling thread until the result arrives and returns it, or throws
/// the call's error (see rpc_async). Throws UsageError on a corpc I/O thread; in a coroutine,
/// `co_await rpc_async<F>(...)` instead.
template <auto F, class... A>
  requires(!detail::first_is_options<A...>)
detail::ResultOf<F> rpc_sync(const WorkerRef& to, A&&... args) {
  return detail::call_function<F>(to, CallOptions{}, true, std::forward<A>(args)...).wait();
}

/// As rpc_sync(to, args...), with per-call options.
template <auto F, class... A>
detail::ResultOf<F> rpc_sync(const WorkerRef& to, const CallOptions& options, A&&... args) {
  return detail::call_function<F>(to, options, true, std::forward<A>(args)...).wait();
}

/// By name, for functions registered with register_function in another binary. R: the expected result type;
/// the arguments' own (decayed) types must match the callee's parameter types, except that string literals and
/// char pointers are sent as std::string:
/// ```cpp
///   corpc::rpc_async<std::string>("worker1", "greet", "hello", 3);   // greet(std::string, int)
/// ```
template <class R, class... A>
  requires(!detail::first_is_options<A...>)
Future<R> rpc_async(const WorkerRef& to, std::string_view function, A&&... args) {
  return rpc_async<R>(to, function, CallOptions{}, std::forward<A>(args)...);
}

/// As the by-name rpc_async above, with per-call options.
template <class R, class... A>
Future<R> rpc_async(const WorkerRef& to, std::string_view function, const CallOptions& options, A&&... args) {
  using Args = std::tuple<detail::by_name_arg_t<A>...>;
  return detail::call_remote<R, Args>(to, function, detail::signature_of<Args>(), options, std::forward<A>(args)...);
}

}  // namespace corpc
