// corpc/rpc/detail/call.hpp — the machinery behind rpc_async and register_function (corpc/rpc/call.hpp): how
// arguments are converted and encoded at the call site, how a registered function is decoded, run and its result
// encoded on the callee, and how a call's future is completed from its reply.
#pragma once

#include <functional>
#include <memory>
#include <stop_token>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "corpc/core/future.hpp"
#include "corpc/core/task.hpp"
#include "corpc/core/type_name.hpp"
#include "corpc/rpc/detail/function_traits.hpp"
#include "corpc/rpc/detail/outbound.hpp"
#include "corpc/rpc/detail/registry.hpp"
#include "corpc/rpc/options.hpp"
#include "corpc/rpc/runtime.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/tensor_codec.hpp"
#include "corpc/wire/torch_codec.hpp"

namespace corpc::detail {

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
// limits) touches nothing else. `send_now`: the caller blocks on the result next (rpc_sync).
template <class R, class ArgsTuple, class... A>
Future<R> call_remote(const WorkerRef& to, std::string_view function, bool function_is_static, std::uint64_t id,
                      std::uint64_t signature, const CallOptions& options, bool send_now, A&&... a) {
  auto* state = FutureState<R>::make();  // this reference is the call's, released by complete_call
  Future<R> fut = future_of(state);
  try {
    Runtime& runtime = Runtime::get();
    OutboundCall call;
    call.dst = runtime.worker(to).rank;
    call.function = function;
    call.function_is_static = function_is_static;
    call.function_id = id;
    call.signature = signature;
    call.sent_types = type_name<ArgsTuple>();
    call.timeout = options.timeout;
    call.send_now = send_now;
    encode_args<ArgsTuple>(call.message, call.dst, std::forward<A>(a)...);
    call.complete = &complete_call<R>;
    call.target = state;
    call.cancel = state;
    start_call(runtime, std::move(call));
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
  return call_remote<R, ArgsTuple>(to, function, false, function_id(function), signature, options, false,
                                   std::forward<A>(a)...);
}

// Calls the function F names (the body of rpc_async and rpc_sync).
template <auto F, class... A>
Future<ResultOf<F>> call_function(const WorkerRef& to, const CallOptions& options, bool send_now, A&&... args) {
  (void)AutoRegistered<F>::value;
  using Tr = FnTraits<decltype(F)>;
  static constexpr std::uint64_t id = function_id(function_name<F>());
  return call_remote<ResultOf<F>, typename Tr::Args>(
      to, function_name<F>(), true, id, signature_of<typename Tr::Args>(), options, send_now, std::forward<A>(args)...);
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

// Sends control message F and forgets it, in the runtime's background scope (graceful shutdown waits for it; a stop
// requested on the sender's own work does not cancel it). Dropped once shutdown has joined the scope.
template <auto F, class... A>
void send_control(int to, A... args) {
  auto* rt = Runtime::try_get();
  if (!rt) return;
  (void)rt->spawn_background([](int to, A... args) -> Task<void> {
    try {
      co_await call_function<F>(to, CallOptions{}, false, std::move(args)...);
    } catch (...) {
      // The peer died or this worker is shutting down: the protocol's bookkeeping goes with it.
    }
  }(to, std::move(args)...));
}
}  // namespace corpc::detail
