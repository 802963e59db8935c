// corpc/rpc/call.hpp — rpc_async, rpc_sync: calling a function on another worker.
//
//   int add(int a, int b);
//   corpc::Future<int> f = corpc::rpc_async<&add>("worker1", 1, 2);   // eager: the request is on its way
//   int three = co_await f;                                             // or f.wait() outside a coroutine
//   int same = corpc::rpc_sync<&add>(1, 1, 2);                          // by rank, blocking
//   auto g = corpc::rpc_async<&add>("worker1", corpc::with_timeout(100ms), 1, 2);
//
// Arguments are converted to the function's parameter types at the call site, so a mismatch is a compile error.
// The function may be a plain function, or return Task<T> / Future<T>: the callee then holds no thread while it waits
// (what PyTorch calls @async_execution), and the caller receives T.
// Errors arrive on the future: RemoteError (the function threw), TimeoutError, ConnectionError, UnknownWorkerError,
// UnknownFunctionError, ArgumentTypeError.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "corpc/core/task.hpp"
#include "corpc/rpc/function_traits.hpp"
#include "corpc/rpc/registry.hpp"
#include "corpc/rpc/runtime.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/tensor_codec.hpp"

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
  }(std::index_sequence_for<A...>{});
}

template <class ArgsTuple>
ArgsTuple decode_args(Reader& r) {
  ArgsTuple args = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return ArgsTuple{r.get<std::tuple_element_t<I, ArgsTuple>>()...};  // braced: left-to-right
  }(std::make_index_sequence<std::tuple_size_v<ArgsTuple>>{});
  if (r.remaining() != 0) throw ProtocolError("trailing bytes after the arguments");
  return args;
}

template <class T>
Message encode_reply(const T& value, int dst) {
  Message m = make_reply();
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
    co_return make_reply();
  } else {
    co_return encode_reply(co_await fn(), dst);
  }
}

// Runs `fn` and turns its result — a value, void, Task<T> or Future<T> — into the reply for `dst`. `fn` owns the
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
      return (*keep)().then([keep] { return make_reply(); });
    } else {
      return (*keep)().then([keep, dst](const T& v) { return encode_reply(v, dst); });
    }
  } else if constexpr (std::is_void_v<R>) {
    fn();
    return make_ready_future(make_reply());
  } else {
    return make_ready_future(encode_reply(fn(), dst));
  }
}

// A registry entry whose callers must send arguments of the types in ArgsTuple.
template <class ArgsTuple>
HandlerEntry typed_entry(Handler handler) {
  HandlerEntry e;
  e.signature = signature_of<ArgsTuple>();
  e.signature_text = std::string(type_name<ArgsTuple>());
  e.handler = std::move(handler);
  return e;
}

// The handler entry for a free function F.
template <auto F>
HandlerEntry make_entry() {
  using Tr = FnTraits<decltype(F)>;
  static_assert(std::is_void_v<typename Tr::Class>, "member functions are called through an RRef (rref.rpc_async)");
  return typed_entry<typename Tr::Args>([](Inbound& in) -> Future<Message> {
    return run_and_encode(
        [args = decode_args<typename Tr::Args>(in.args)]() mutable -> decltype(auto) {
          return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
            return F(forward_param<std::tuple_element_t<I, typename Tr::Params>>(std::get<I>(args))...);
          }(std::make_index_sequence<std::tuple_size_v<typename Tr::Args>>{});
        },
        in.src);
  });
}

// Static registration the first time a program mentions rpc to F: every process running this binary then has it.
template <auto F>
struct AutoRegistered {
  static inline const bool value = [] {
    global_registry().add(std::string(function_name<F>()), make_entry<F>());
    return true;
  }();
};

// Issues the call and returns the future of its decoded result.
template <class R, class ArgsTuple, class... A>
Future<R> call_remote(const WorkerRef& to, std::string_view function, std::uint64_t signature,
                      const CallOptions& options, A&&... a) {
  auto promise = std::make_shared<Promise<R>>();
  auto fut = promise->get_future();
  try {
    Runtime& rt = Runtime::get();
    const int dst = rt.worker(to).rank;
    Message req = Runtime::begin_request(function, signature);
    encode_args<ArgsTuple>(req, dst, std::forward<A>(a)...);
    rt.call(dst, std::move(req), options, [promise, dst](Message* reply, std::exception_ptr error) {
      if (error) return void(promise->set_exception(error));
      try {
        Reader r = Runtime::reply_reader(*reply, dst);
        if constexpr (std::is_void_v<R>) {
          promise->set_value();
        } else {
          promise->set_value(r.get<R>());
        }
      } catch (...) {
        promise->set_exception(std::current_exception());
      }
    });
  } catch (...) {
    promise->set_exception(std::current_exception());
  }
  return fut;
}

template <class... A>
inline constexpr bool first_is_options = false;
template <class A0, class... A>
inline constexpr bool first_is_options<A0, A...> = std::is_same_v<std::decay_t<A0>, CallOptions>;

}  // namespace detail

// Registers F under an explicit name, for callers built from other sources (they call by name).
template <auto F>
void register_function(std::string name) {
  global_registry().add(std::move(name), detail::make_entry<F>());
}

template <auto F, class... A>
  requires(!detail::first_is_options<A...>)
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, A&&... args) {
  (void)detail::AutoRegistered<F>::value;
  using Tr = detail::FnTraits<decltype(F)>;
  return detail::call_remote<detail::ResultOf<F>, typename Tr::Args>(
      to, function_name<F>(), detail::signature_of<typename Tr::Args>(), CallOptions{}, std::forward<A>(args)...);
}

template <auto F, class... A>
Future<detail::ResultOf<F>> rpc_async(const WorkerRef& to, const CallOptions& options, A&&... args) {
  (void)detail::AutoRegistered<F>::value;
  using Tr = detail::FnTraits<decltype(F)>;
  return detail::call_remote<detail::ResultOf<F>, typename Tr::Args>(
      to, function_name<F>(), detail::signature_of<typename Tr::Args>(), options, std::forward<A>(args)...);
}

template <auto F, class... A>
decltype(auto) rpc_sync(const WorkerRef& to, A&&... args) {
  auto fut = rpc_async<F>(to, std::forward<A>(args)...);
  if constexpr (std::is_void_v<detail::ResultOf<F>>) {
    fut.wait();
  } else {
    return detail::ResultOf<F>(fut.wait());
  }
}

// By name, for functions registered with register_function in another binary. R: the expected result type;
// the arguments' own (decayed) types must match the callee's parameter types.
template <class R, class... A>
Future<R> rpc_async(const WorkerRef& to, std::string_view function, A&&... args) {
  using Args = std::tuple<std::decay_t<A>...>;
  return detail::call_remote<R, Args>(to, function, detail::signature_of<Args>(), CallOptions{}, std::forward<A>(args)...);
}

}  // namespace corpc
