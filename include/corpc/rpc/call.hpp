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

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "corpc/core/task.hpp"
#include "corpc/rpc/function_traits.hpp"
#include "corpc/rpc/detail/registry.hpp"
#include "corpc/rpc/outbound.hpp"
#include "corpc/rpc/runtime.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/tensor_codec.hpp"
#include "corpc/wire/torch_codec.hpp"

namespace corpc {

namespace detail {

// Encodes `a...` as the parameter types in ArgsTuple, converting each at the call site.
template <class ArgsTuple, class... A>
void encode_args(Message& msg, int dst, A&&... a) {
  static_assert(std::tuple_size_v<ArgsTuple> == sizeof...(A), "wrong number of arguments for this function");
  Writer w(msg.body);
  w.tensors = &msg.tensors;
  w.peer = dst;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          using P = std::tuple_element_t<I, ArgsTuple>;
          auto&& arg = std::get<I>(std::forward_as_tuple(std::forward<A>(a)...));
          if constexpr (std::is_same_v<std::decay_t<decltype(arg)>, P>) {
            w.put(arg);
          } else {
            static_assert(std::is_constructible_v<P, decltype(arg)>, "argument not convertible to the parameter type");
            w.put(P(std::forward<decltype(arg)>(arg)));
          }
        }(),
        ...);
  }
  (std::index_sequence_for<A...>{});
}

template <class ArgsTuple>
ArgsTuple decode_args(Reader& r) {
  ArgsTuple args = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return ArgsTuple{r.get<std::tuple_element_t<I, ArgsTuple>>()...};  // braced: left-to-right
  }
  (std::make_index_sequence<std::tuple_size_v<ArgsTuple>>{});
  if (r.remaining() != 0) throw ProtocolError("trailing bytes after the arguments");
  return args;
}

// The reply carrying `value` to `dst` (its body; the runtime fills in the header).
template <class T>
Message encode_reply(const T& value, int dst) {
  Message m;
  Writer w(m.body);
  w.tensors = &m.tensors;
  w.peer = dst;
  w.put(value);
  return m;
}

// Calls `fn` and encodes the result of the Task it returns. `fn` (which owns the decoded arguments) lives in this
// frame until the task has finished, so a coroutine taking its parameters by reference never sees them dangle.
template <class Fn>
Task<Message> encode_when_done(Fn fn, int dst) {
  using T = typename Unwrap<std::invoke_result_t<Fn&>>::type;
  if constexpr (std::is_void_v<T>) {
    co_await fn();
    co_return Message{};
  } else {
    co_return encode_reply(co_await fn(), dst);
  }
}

// Runs `fn` and turns its result — Task<T> or Future<T> — into the future of the reply for `dst`. `fn` owns the
// arguments and is kept alive until the result is complete.
template <class Fn>
Future<Message> run_and_encode(Fn fn, int dst) {
  using R = std::invoke_result_t<Fn&>;
  if constexpr (Unwrap<R>::is_task) {
    return spawn(encode_when_done(std::move(fn), dst));
  } else if constexpr (Unwrap<R>::is_future) {
    using T = typename Unwrap<R>::type;
    auto keep = std::make_shared<Fn>(std::move(fn));
    if constexpr (std::is_void_v<T>) {
      return (*keep)().then([keep] { return Message{}; });
    } else {
      return (*keep)().then([keep, dst](const T& v) { return encode_reply(v, dst); });
    }
  } else if constexpr (std::is_void_v<R>) {
    fn();
    return make_ready_future(Message{});
  } else {
    return make_ready_future(encode_reply(fn(), dst));
  }
}

// A registry entry whose callers must send arguments of the types in ArgsTuple; `handler` is the asynchronous form.
template <class ArgsTuple>
HandlerEntry typed_entry(std::string name, std::function<Future<Message>(Inbound&)> handler,
                         Execution execution = Execution::worker_pool) {
  HandlerEntry e;
  e.name = std::move(name);
  e.signature = signature_of<ArgsTuple>();
  e.signature_text = std::string(type_name<ArgsTuple>());
  e.execution = execution;
  e.run_async = std::move(handler);
  return e;
}

template <class ArgsTuple>
HandlerEntry typed_entry(std::function<Future<Message>(Inbound&)> handler) {
  return typed_entry<ArgsTuple>(std::string(), std::move(handler));
}

// Calls F with arguments decoded from `args`.
template <auto F>
decltype(auto) invoke_decoded(typename FnTraits<decltype(F)>::Args& args) {
  using Tr = FnTraits<decltype(F)>;
  return [&]<std::size_t... I>(std::index_sequence<I...>)->decltype(auto) {
    return F(forward_param<std::tuple_element_t<I, typename Tr::Params>>(std::get<I>(args))...);
  }
  (std::make_index_sequence<std::tuple_size_v<typename Tr::Args>>{});
}

// The synchronous handler of a plain function F: no future, no allocation beyond the reply's own body.
template <auto F>
void run_plain(Inbound& in, Message& reply) {
  using Tr = FnTraits<decltype(F)>;
  auto args = decode_args<typename Tr::Args>(in.args);
  if constexpr (std::is_void_v<typename Tr::Result>) {
    invoke_decoded<F>(args);
  } else {
    reply = encode_reply(invoke_decoded<F>(args), in.src);
  }
}

// The handler entry for a free function F, registered as `name`.
template <auto F>
HandlerEntry make_entry(std::string name, Execution execution = execution_of<F>) {
  using Tr = FnTraits<decltype(F)>;
  static_assert(std::is_void_v<typename Tr::Class>, "member functions are called through an RRef (rref.rpc_async)");
  using R = typename Tr::Result;
  if constexpr (Unwrap<R>::is_task || Unwrap<R>::is_future) {
    return typed_entry<typename Tr::Args>(
        std::move(name),
        [](Inbound& in) -> Future<Message> {
          return run_and_encode([args = decode_args<typename Tr::Args>(
                                     in.args)]() mutable -> decltype(auto) { return invoke_decoded<F>(args); },
                                in.src);
        },
        execution);
  } else {
    HandlerEntry e;
    e.name = std::move(name);
    e.signature = signature_of<typename Tr::Args>();
    e.signature_text = std::string(type_name<typename Tr::Args>());
    e.execution = execution;
    e.run_sync = &run_plain<F>;
    return e;
  }
}

// Static registration the first time a program mentions rpc to F: every process running this binary then has it.
template <auto F>
struct AutoRegistered {
  static inline const bool value = [] {
    global_registry().add(make_entry<F>(std::string(function_name<F>())));
    return true;
  }();
};

// Completes a call's future from its reply (see OutboundCall::complete).
template <class R>
void complete_call(void* target, int src, Message* reply, std::exception_ptr error) noexcept {
  auto* state = static_cast<FutureState<R>*>(target);
  if (error) {
    state->set_exception(std::move(error));
  } else {
    try {
      Reader r(reply->body.data(), reply->body.size());
      r.tensors = &reply->tensors;
      r.peer = src;
      if constexpr (std::is_void_v<R>) {
        state->set_value();
      } else {
        state->set_value(r.get<R>());
      }
    } catch (...) {
      state->set_exception(std::current_exception());
    }
  }
  state->release();
}

// Cancels `fut` when `token` is stopped, until `fut` completes (the link is released then).
template <class R>
void cancel_on_stop(const Future<R>& fut, const std::stop_token& token) {
  struct Cancel {
    FutureState<R>* s;
    void operator()() const noexcept { s->cancel(); }
  };
  struct Link {
    Future<R> fut;  // keeps the state alive for the callback
    std::stop_callback<Cancel> on_stop;
    Link(const Future<R>& f, const std::stop_token& t) : fut(f), on_stop(t, Cancel{state_of(f)}) {}
  };
  auto* link = new Link(fut, token);
  on_ready_inline(fut, [link] { delete link; });
}

// Issues the call and returns the future of its decoded result. Never throws: every failure lands on the future,
// and one that happens before the request is sent (encoding, an unknown worker, a message over the receiver's
// limits) touches nothing else.
template <class R, class ArgsTuple, class... A>
Future<R> call_remote(const WorkerRef& to, std::string_view function, bool function_is_static, std::uint64_t id,
                      std::uint64_t signature, const CallOptions& options, A&&... a) {
  auto* state = FutureState<R>::make();  // this reference is the call's, released by complete_call
  Future<R> fut = future_of(state);
  try {
    OutboundCall call;
    call.dst = Runtime::get().worker(to).rank;
    call.function = function;
    call.function_is_static = function_is_static;
    call.function_id = id;
    call.signature = signature;
    call.sent_types = type_name<ArgsTuple>();
    call.timeout = options.timeout;
    encode_args<ArgsTuple>(call.message, call.dst, std::forward<A>(a)...);
    call.complete = &complete_call<R>;
    call.target = state;
    call.cancel = state;
    start_call(std::move(call));
  } catch (...) {
    state->set_exception(std::current_exception());
    state->release();
  }
  if (options.stop_token.stop_possible() && !fut.done()) cancel_on_stop(fut, options.stop_token);
  return fut;
}

template <class R, class ArgsTuple, class... A>
Future<R> call_remote(const WorkerRef& to, std::string_view function, std::uint64_t signature,
                      const CallOptions& options, A&&... a) {
  return call_remote<R, ArgsTuple>(to, function, false, function_id(function), signature, options,
                                   std::forward<A>(a)...);
}

// The type a by-name call sends for an argument of type A: its decayed type, except that character strings
// (literals, char pointers) travel as std::string.
template <class A>
using by_name_arg_t =
    std::conditional_t<std::is_same_v<std::decay_t<A>, const char*> || std::is_same_v<std::decay_t<A>, char*>,
                       std::string, std::decay_t<A>>;

template <class... A>
inline constexpr bool first_is_options = false;
template <class A0, class... A>
inline constexpr bool first_is_options<A0, A...> = std::is_same_v<std::decay_t<A0>, CallOptions>;

}  // namespace detail

/// Registers F under an explicit name, for callers built from other sources (they call by name).
template <auto F>
void register_function(std::string name, Execution execution = execution_of<F>) {
  detail::global_registry().add(detail::make_entry<F>(std::move(name), execution));
}

/// Calls `F(args...)` on worker `to` and returns the Future of its result at once: the request is on its way, or
/// waits behind RpcOptions::max_calls_in_flight_per_peer (only a caller on a thread without a corpc executor blocks
/// here then). F is a function pointer constant (`&f`); if it returns
/// Task<T> or Future<T>, the result is T. `args` are converted to F's parameter types here (a mismatch does not
/// compile) and encoded with their Codecs before this returns, so they may be destroyed at once.
///
/// Never throws: every failure completes the future, with RemoteError (F threw), TimeoutError, ConnectionError,
/// UnknownWorkerError, UnknownFunctionError, ArgumentTypeError, MessageTooLargeError, ShutdownError (no runtime),
/// or CancelledError after `cancel()`. On the callee F runs on the worker pool, or on the I/O thread for
/// Execution::io_thread functions. Any thread may call it; examples in corpc/rpc/call.hpp.
template <auto F, class... A>
  requires(!detail::first_is_options<A...>)
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, A&&... args) {
  return rpc_async<F>(to, CallOptions{}, std::forward<A>(args)...);
}

/// As rpc_async(to, args...), with per-call options: a timeout (with_timeout) or a stop token (with_stop_token).
template <auto F, class... A>
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, const CallOptions& options, A&&... args) {
  (void)detail::AutoRegistered<F>::value;
  using Tr = detail::FnTraits<decltype(F)>;
  static constexpr std::uint64_t id = function_id(function_name<F>());
  return detail::call_remote<detail::ResultOf<F>, typename Tr::Args>(
      to, function_name<F>(), true, id, detail::signature_of<typename Tr::Args>(), options, std::forward<A>(args)...);
}

/// `rpc_async<F>(to, args...).wait()`: blocks the calling thread until the result arrives and returns it, or throws
/// the call's error (see rpc_async). `args` may start with CallOptions. Throws UsageError on a corpc I/O thread;
/// in a coroutine, `co_await rpc_async<F>(...)` instead.
template <auto F, class... A>
detail::ResultOf<F> rpc_sync(const WorkerRef& to, A&&... args) {
  auto result = [&] {
    detail::SendNowScope now;
    return rpc_async<F>(to, std::forward<A>(args)...);
  }();
  return std::move(result).wait();
}

namespace detail {
// Sends control message F and forgets it, in the runtime's background scope (graceful shutdown waits for it; a stop
// requested on the sender's own work does not cancel it). Dropped once shutdown has joined the scope.
template <auto F, class... A>
void send_control(int to, A... args) {
  auto* rt = Runtime::try_get();
  if (!rt) return;
  (void)rt->spawn_background([](int to, A... args) -> Task<void> {
    try {
      co_await rpc_async<F>(to, std::move(args)...);
    } catch (...) {
      // The peer died or this worker is shutting down: the protocol's bookkeeping goes with it.
    }
  }(to, std::move(args)...));
}
}  // namespace detail

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
