// The requests behind remote() and an RRef's proxy calls: their wire forms, the handlers that run them on the owner
// (registered under names derived from what they run, on first use), and the sending of a creation. Part of
// corpc/rref/rref.hpp, which includes it after the declarations it uses.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "corpc/rpc/call.hpp"
#include "corpc/rref/detail/context.hpp"
#include "corpc/rref/detail/owner.hpp"

namespace corpc::detail {

// The tuple of A's and B's element types, without constructing either: parameter types need no default constructor.
template <class A, class B>
struct TupleCat;
template <class... A, class... B>
struct TupleCat<std::tuple<A...>, std::tuple<B...>> {
  using type = std::tuple<A..., B...>;
};
template <class A, class B>
using tuple_cat_t = typename TupleCat<A, B>::type;

// Handlers registered under names derived from what they run (`Tag::name()`), added before main like rpc functions.
template <class Tag>
struct AutoEntry {
  static inline const bool value = [] {
    HandlerEntry e = Tag::entry();
    e.name = Tag::name();
    global_registry().add(std::move(e));
    return true;
  }();
};

template <class ArgsTuple, class Body>
HandlerEntry entry_for(Body body) {
  return typed_entry<ArgsTuple>([body](Inbound& in) { return body(in.src, decode_args<ArgsTuple>(in.args)); });
}

// For creation requests, whose first field is the new value's id: if the rest cannot be decoded, whoever already
// waits on that value (a message may have overtaken the creation) gets the error instead of waiting for ever.
template <class Wire, class Body>
HandlerEntry creation_entry(Body body) {
  return typed_entry<Wire>([body](Inbound& in) -> Future<Message> {
    Reader peek = in.args;
    const RRefId id = peek.get<RRefId>();
    std::optional<Wire> all;
    try {
      all.emplace(decode_args<Wire>(in.args));
    } catch (...) {
      RRefContext::get()->abandon_creation(id, std::current_exception());
      throw;
    }
    return body(in.src, std::move(*all));
  });
}

// Splits a tuple into its first N elements and the rest.
template <std::size_t N, class Tuple>
auto tail(Tuple&& t) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(std::get<N + I>(std::forward<Tuple>(t))...);
  }
  (std::make_index_sequence<std::tuple_size_v<std::decay_t<Tuple>> - N>{});
}

// Claims the slot for a creation from `creator` and computes `fn` into it on the worker pool; replies at once.
template <class R, class Fn>
Future<Message> create_in_slot(int creator, const RRefId& id, const ForkId& fork, Fn fn) {
  auto ctx = RRefContext::get();
  auto slot = ctx->slot(id);
  ctx->add_fork(id, fork, creator);
  ctx->claim(slot);
  // In the runtime's background scope: graceful shutdown waits for the value (its computation may call peers), and a
  // shutdown that gives up stops it. Its context is the request's (deadline, autograd context), with the scope's stop.
  if (!Runtime::get().spawn_background(fill_slot<R>(ctx, slot, std::move(fn)),
                                       Runtime::Background::on_behalf_of_caller))
    ctx->fail(slot, std::make_exception_ptr(ShutdownError("the owner is shutting down: the value was never computed")));
  return make_ready_future(Message{});
}

// remote<F>(to, args...): create the result of F(args...) on the owner.
template <auto F>
struct CreateCall {
  using Args = typename FnTraits<decltype(F)>::Args;
  using Wire = tuple_cat_t<std::tuple<RRefId, ForkId>, Args>;
  static std::string name() { return "corpc::remote<" + std::string(function_name<F>()) + ">"; }
  static HandlerEntry entry() {
    return creation_entry<Wire>([](int src, Wire all) {
      auto id = std::get<0>(all);
      auto fork = std::get<1>(all);
      return create_in_slot<ResultOf<F>>(src, id, fork, [args = tail<2>(std::move(all))]() mutable -> decltype(auto) {
        return [&]<std::size_t... I>(std::index_sequence<I...>)->decltype(auto) {
          using P = typename FnTraits<decltype(F)>::Params;
          return F(forward_param<std::tuple_element_t<I, P>>(std::get<I>(args))...);
        }
        (std::make_index_sequence<std::tuple_size_v<Args>>{});
      });
    });
  }
};

// remote<T>(to, args...): construct a T on the owner.
template <class T, class... A>
struct CreateObject {
  using Wire = std::tuple<RRefId, ForkId, A...>;
  static std::string name() {
    return "corpc::remote<" + std::string(type_name<T>()) + std::string(type_name<std::tuple<A...>>()) + ">";
  }
  static HandlerEntry entry() {
    return creation_entry<Wire>([](int src, Wire all) {
      auto ctx = RRefContext::get();
      auto id = std::get<0>(all);
      auto slot = ctx->slot(id);
      ctx->add_fork(id, std::get<1>(all), src);
      ctx->claim(slot);
      try {
        auto obj = std::apply([](auto&&, auto&&, auto&&... a) { return std::make_shared<T>(std::move(a)...); },
                              std::move(all));
        SelfBinder::bind(*obj, slot);
        ctx->fulfil(slot, std::move(obj), type_hash_of<T>());
      } catch (...) {
        ctx->fail(slot, std::current_exception());
      }
      return make_ready_future(Message{});
    });
  }
};

// rref.rpc_async<M>(args...): call member M on the owner and return its result.
template <auto M>
struct InvokeMember {
  using Args = typename FnTraits<decltype(M)>::Args;
  using Wire = tuple_cat_t<std::tuple<RRefId>, Args>;
  static std::string name() { return "corpc::rref_call<" + std::string(function_name<M>()) + ">"; }
  static HandlerEntry entry() {
    return entry_for<Wire>([](int src, Wire all) {
      auto slot = RRefContext::get()->slot(std::get<0>(all));
      return run_and_encode(
          [slot, args = tail<1>(std::move(all))]() mutable { return invoke_member<M>(slot, std::move(args)); }, src);
    });
  }
};

// rref.remote<M>(args...): call member M on the owner and keep the result there, as a new RRef.
template <auto M>
struct CreateFromMember {
  using Args = typename FnTraits<decltype(M)>::Args;
  using Wire = tuple_cat_t<std::tuple<RRefId, ForkId, RRefId>, Args>;  // new id, fork, target
  static std::string name() { return "corpc::rref_remote<" + std::string(function_name<M>()) + ">"; }
  static HandlerEntry entry() {
    return creation_entry<Wire>([](int src, Wire all) {
      auto target = RRefContext::get()->slot(std::get<2>(all));
      return create_in_slot<ResultOf<M>>(
          src, std::get<0>(all), std::get<1>(all),
          [target, args = tail<3>(std::move(all))]() mutable { return invoke_member<M>(target, std::move(args)); });
    });
  }
};

// Sends a creation request and returns the user reference it makes; confirmed when the owner acknowledges.
template <class R, class Tag, class... A>
RRef<R> create_remote(const WorkerRef& to, const CallOptions& options, A&&... args) {
  (void)AutoEntry<Tag>::value;
  static const std::string name = Tag::name();
  auto ctx = RRefContext::get();
  const int dst = Runtime::get().worker(to).rank;
  const RRefId id = ctx->new_id();
  auto state = ctx->new_user(id, id, dst, type_hash_of<R>());
  auto ack = call_remote<void, typename Tag::Wire>(dst, name, signature_of<typename Tag::Wire>(), options, id, id,
                                                   std::forward<A>(args)...);
  on_ready_inline(ack, [ack, confirm = state->confirm_promise] {
    if (auto e = ack.error()) confirm->set_exception(e);
    else confirm->set_value();
  });
  return RRef<R>(std::move(state));
}

}  // namespace corpc::detail
