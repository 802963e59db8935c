/// @file
/// RRef<T>: a reference to a value that lives on one worker (its owner), usable from any worker.
///
/// ```cpp
///   corpc::RRef<at::Tensor> y = corpc::remote<&make_tensor>("worker1", 3);   // returns at once; worker1 computes
///   at::Tensor here = co_await y.to_here();                                   // or y.to_here().wait()
///   auto counter = corpc::remote<Counter>("worker2", 10);                     // constructs a Counter on worker2
///   int v = co_await counter.rpc_async<&Counter::add>(5);                     // runs counter->add(5) on worker2
///   corpc::RRef<int> w = counter.remote<&Counter::add>(1);                    // result stays on worker2
///   int t = co_await counter.rpc_async<&Counter::add>(corpc::with_timeout(100ms), 1);   // TimeoutError after 100 ms
/// ```
///
/// Every call here takes a CallOptions first, as rpc_async does (`with_timeout(ms)`; unset: RpcOptions::rpc_timeout).
/// For remote() the timeout bounds the owner's acknowledgement of the creation; a creation that timed out fails the
/// reference's next use with TimeoutError.
///
/// An RRef can be passed to any worker as an argument or a result; the owner keeps the value exactly as long as some
/// reference to it exists anywhere (protocol and guarantees: corpc/rref/context.hpp). `remote()` and proxy calls do
/// not wait for their inputs: a call on a value that is still being computed waits for it on the owner, so
/// `p2.rpc_async<&S2::forward>(p1.remote<&S1::forward>(x))` never routes through the caller.
///
/// A failed creation surfaces on the next use (to_here, proxy call) as the error the creator raised.
///
/// Concurrency on a remote object: proxy calls run concurrently by default, as in PyTorch (the object guards its own
/// state), because most remote objects are read-mostly (modules in inference, parameter servers with their own lock)
/// and serializing them would cost parallelism silently. An object that declares
/// ```cpp
///   static constexpr bool corpc_serialized_calls = true;
/// ```
/// gets one call at a time, in the order the owner dispatches them, without blocking a worker thread while it waits.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>

#include "corpc/rpc/call.hpp"
#include "corpc/rref/context.hpp"

namespace corpc {

template <class T>
class RRef;

namespace detail {
struct SelfBinder;
}

/// Gives an object held by an RRef a reference to itself, as Python's `RRef(self)`: derive from
/// EnableRRefFromThis<T> and call rref_from_this() (on the owner, for example inside a method called through a
/// proxy) to hand other workers a reference to this object:
/// ```cpp
///   struct Agent : corpc::EnableRRefFromThis<Agent> {
///     corpc::Task<int> run() { co_return co_await corpc::rpc_async<&observe>("observer1", rref_from_this()); }
///   };
/// ```
/// The object keeps no reference to itself (only a weak link to its owner slot), so it is freed when the last
/// reference held elsewhere goes; do not store the result of rref_from_this() in the object itself, which would keep
/// it alive for ever. Works for objects created by remote<T>(...), remote<&f>(...) and RRef<T>(value).
template <class T>
class EnableRRefFromThis {
 public:
  /// A new owner reference to this object. Throws UsageError if no RRef holds the object (made on the stack, copied,
  /// or created some other way). Call it on the owner, from any thread.
  RRef<T> rref_from_this() const;

 protected:
  EnableRRefFromThis() = default;  ///< not held by any RRef until an RRef creation stores the object
  EnableRRefFromThis(const EnableRRefFromThis&) noexcept {}  ///< a copy is another object: not held by that RRef
  /// Keeps this object's own link: assignment copies the value, not the identity.
  EnableRRefFromThis& operator=(const EnableRRefFromThis&) noexcept { return *this; }
  ~EnableRRefFromThis() = default;  ///< protected: an object is destroyed as a T, never through this base

 private:
  friend struct detail::SelfBinder;
  std::weak_ptr<detail::OwnerSlot> self_slot_;
};

/// True for a type that declares `static constexpr bool corpc_serialized_calls = true;`: proxy calls on an object of
/// it run one at a time on its owner, in dispatch order (see corpc/rref/rref.hpp).
template <class T>
inline constexpr bool serialized_calls_v = requires { requires T::corpc_serialized_calls; };

namespace detail {

// Links an object that derives from EnableRRefFromThis to the owner slot that holds it.
struct SelfBinder {
  template <class T>
  static void bind(T& object, const std::shared_ptr<OwnerSlot>& slot) {
    if constexpr (std::is_base_of_v<EnableRRefFromThis<T>, T>) object.EnableRRefFromThis<T>::self_slot_ = slot;
  }
};

// The tuple of A's and B's element types, without constructing either: parameter types need no default constructor.
template <class A, class B>
struct TupleCat;
template <class... A, class... B>
struct TupleCat<std::tuple<A...>, std::tuple<B...>> {
  using type = std::tuple<A..., B...>;
};
template <class A, class B>
using tuple_cat_t = typename TupleCat<A, B>::type;

template <class T>
constexpr std::uint64_t type_hash_of() {
  return fnv1a(type_name<T>());
}

// Any callable's result — a value, void, Task<T> or Future<T> — as a Task.
template <class Fn>
auto as_task(Fn fn) -> Task<typename Unwrap<std::invoke_result_t<Fn&>>::type> {
  using R = std::invoke_result_t<Fn&>;
  if constexpr (Unwrap<R>::is_task || Unwrap<R>::is_future) {
    co_return co_await fn();
  } else if constexpr (std::is_void_v<R>) {
    fn();
  } else {
    co_return fn();
  }
}

// Computes a value into an owner slot; errors are stored there and raised at the slot's next use.
template <class R, class Fn>
Task<void> fill_slot(std::shared_ptr<RRefContext> ctx, std::shared_ptr<OwnerSlot> slot, Fn fn) {
  try {
    if constexpr (std::is_void_v<R>) {
      co_await as_task(std::move(fn));
      ctx->fulfil(slot, std::make_shared<std::monostate>(), type_hash_of<std::monostate>());
    } else {
      R value = co_await as_task(std::move(fn));
      auto stored = std::make_shared<R>(std::move(value));
      SelfBinder::bind(*stored, slot);
      ctx->fulfil(slot, std::move(stored), type_hash_of<R>());
    }
  } catch (...) {
    ctx->fail(slot, std::current_exception());
  }
}

template <class T>
std::shared_ptr<T> slot_value(const OwnerSlot& slot) {
  slot.ready.value();  // rethrows a failed creation
  if (slot.type_hash != type_hash_of<T>())
    throw ArgumentTypeError("RRef holds a different type than " + std::string(type_name<T>()));
  return std::static_pointer_cast<T>(slot.value);
}

// Runs `call` and keeps its result in `out` (serialized proxy calls hand results back this way).
template <class R, class Call, class Out>
Task<void> store_result(Call call, std::shared_ptr<Out> out) {
  if constexpr (std::is_void_v<R>) {
    co_await as_task(std::move(call));
    out->emplace();
  } else {
    out->emplace(co_await as_task(std::move(call)));
  }
}

// Calls member M on the object in `slot` once it exists, honouring serialized_calls_v.
template <auto M, class Args>
auto invoke_member(std::shared_ptr<OwnerSlot> slot, Args args) -> Task<ResultOf<M>> {
  using Tr = FnTraits<decltype(M)>;
  using C = typename Tr::Class;
  using R = ResultOf<M>;
  co_await slot->ready;
  std::shared_ptr<C> obj = slot_value<C>(*slot);
  auto call = [obj, args = std::move(args)]() mutable -> decltype(auto) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
      return ((*obj).*M)(forward_param<std::tuple_element_t<I, typename Tr::Params>>(std::get<I>(args))...);
    }(std::make_index_sequence<std::tuple_size_v<Args>>{});
  };
  if constexpr (serialized_calls_v<C>) {
    // Named locals, not temporaries inside the co_await: GCC 12 mishandles lambda temporaries in await operands.
    auto out = std::make_shared<std::optional<std::conditional_t<std::is_void_v<R>, std::monostate, R>>>();
    std::function<Future<void>()> job = [call = std::move(call), out]() mutable {
      return spawn(store_result<R>(std::move(call), out));
    };
    Future<void> done = RRefContext::get()->run_serialized(slot, std::move(job));
    co_await done;
    if constexpr (!std::is_void_v<R>) co_return std::move(**out);
  } else {
    co_return co_await as_task(std::move(call));
  }
}

template <class T>
Task<T> rref_fetch(RRefId id) {
  auto slot = RRefContext::get()->slot(id);
  co_await slot->ready;
  co_return *slot_value<T>(*slot);
}

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
  }(std::make_index_sequence<std::tuple_size_v<std::decay_t<Tuple>> - N>{});
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
  auto& rt = Runtime::get();
  (void)rt.background().spawn(rt.executor(), fill_slot<R>(ctx, slot, std::move(fn)));
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
        return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
          using P = typename FnTraits<decltype(F)>::Params;
          return F(forward_param<std::tuple_element_t<I, P>>(std::get<I>(args))...);
        }(std::make_index_sequence<std::tuple_size_v<Args>>{});
      });
    });
  }
};

// remote<T>(to, args...): construct a T on the owner.
template <class T, class... A>
struct CreateObject {
  using Wire = std::tuple<RRefId, ForkId, A...>;
  static std::string name() { return "corpc::remote<" + std::string(type_name<T>()) + std::string(type_name<std::tuple<A...>>()) + ">"; }
  static HandlerEntry entry() {
    return creation_entry<Wire>([](int src, Wire all) {
      auto ctx = RRefContext::get();
      auto id = std::get<0>(all);
      auto slot = ctx->slot(id);
      ctx->add_fork(id, std::get<1>(all), src);
      ctx->claim(slot);
      try {
        auto obj = std::apply([](auto&&, auto&&, auto&&... a) { return std::make_shared<T>(std::move(a)...); }, std::move(all));
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
      return run_and_encode([slot, args = tail<1>(std::move(all))]() mutable { return invoke_member<M>(slot, std::move(args)); },
                            src);
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
      return create_in_slot<ResultOf<M>>(src, std::get<0>(all), std::get<1>(all),
                                         [target, args = tail<3>(std::move(all))]() mutable {
                                           return invoke_member<M>(target, std::move(args));
                                         });
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

}  // namespace detail

/// A reference to a `T` that lives on one worker, its owner, usable from any worker (see corpc/rref/rref.hpp).
/// Copies share one reference; passing an RRef to another worker (as an argument or result) shares the value, which
/// the owner keeps while any reference to it exists anywhere. Members may be called from any thread while the
/// runtime runs; those that reach the runtime throw ShutdownError once it has stopped. The calls on the remote
/// object (to_here, rpc_async, remote) fail, on their futures, with the error of a failed creation, or with the
/// errors of rpc_async.
template <class T>
class RRef {
 public:
  using value_type = T;  ///< The referenced type.

  RRef() = default;  ///< An empty reference (`valid()` is false): only assignment is allowed on it.
  /// An owner reference to a value on this worker (share it by passing it to other workers).
  explicit RRef(T value) {
    auto ctx = detail::RRefContext::get();
    auto id = ctx->new_id();
    auto slot = ctx->slot(id);
    state_ = ctx->owner_handle(id, detail::type_hash_of<T>());
    ctx->claim(slot);
    auto stored = std::make_shared<T>(std::move(value));
    detail::SelfBinder::bind(*stored, slot);
    ctx->fulfil(slot, std::move(stored), detail::type_hash_of<T>());
  }
  /// @cond INTERNAL
  explicit RRef(std::shared_ptr<detail::RRefState> state) : state_(std::move(state)) {}
  /// @endcond

  /// False for a default-constructed reference.
  bool valid() const noexcept { return state_ != nullptr; }
  /// The worker that holds the value.
  WorkerInfo owner() const { return Runtime::get().worker(state_->owner); }
  /// The owner's name.
  std::string owner_name() const { return owner().name; }
  /// True on the owner itself.
  bool is_owner() const { return state_->owner == Runtime::get().rank(); }
  /// True once the owner has recorded this reference (always true on the owner).
  bool confirmed_by_owner() const { return is_owner() || (state_->confirmed.done() && !state_->confirmed.has_error()); }

  /// The value itself, on the owner. UsageError elsewhere or while the value is still being computed.
  T& local_value() const {
    if (!is_owner()) throw UsageError("local_value() on a user reference: the value lives on '" + owner_name() + "'");
    auto slot = owner_slot();
    if (!slot->ready.done()) throw UsageError("local_value(): the value is still being computed; await to_here()");
    return *detail::slot_value<T>(*slot);
  }

  /// A copy of the value, fetched from the owner (no copy on the owner itself). Awaitable; `.wait()` blocks. Waits on
  /// the owner until the value has been computed. A `T` without a Codec cannot travel: its future fails with
  /// UsageError (call its methods through rpc_async instead).
  Future<T> to_here(CallOptions options = {}) const {
    if (is_owner()) {
      auto slot = owner_slot();
      return slot->ready.then([slot] { return *detail::slot_value<T>(*slot); });
    }
    if (state_->confirmed.has_error()) return make_exceptional_future<T>(state_->confirmed.error());
    if constexpr (Encodable<T>) {
      (void)detail::AutoRegistered<&detail::rref_fetch<T>>::value;
      return detail::call_remote<T, std::tuple<RRefId>>(state_->owner, function_name<&detail::rref_fetch<T>>(),
                                                        detail::signature_of<std::tuple<RRefId>>(), options, state_->id);
    } else {
      return make_exceptional_future<T>(std::make_exception_ptr(UsageError(
          "to_here(): " + std::string(type_name<T>()) + " cannot be sent (no corpc::Codec); call its methods through the RRef")));
    }
  }

  /// Runs member M of the remote object on its owner: rref.rpc_async<&T::method>([options,] args...). Returns at
  /// once; on the owner the call waits for the value to exist, then runs on the worker pool (one at a time when
  /// serialized_calls_v<T>). Errors as for corpc::rpc_async, on the future.
  template <auto M, class... A>
    requires(!detail::first_is_options<A...>)
  Future<detail::ResultOf<M>> rpc_async(A&&... args) const {
    return rpc_async<M>(CallOptions{}, std::forward<A>(args)...);
  }
  /// As rpc_async(args...), with per-call options (with_timeout, with_stop_token).
  template <auto M, class... A>
  Future<detail::ResultOf<M>> rpc_async(const CallOptions& options, A&&... args) const {
    using Tag = detail::InvokeMember<M>;
    static_assert(std::is_base_of_v<typename detail::FnTraits<decltype(M)>::Class, T>, "M is not a member of T");
    (void)detail::AutoEntry<Tag>::value;
    static const std::string name = Tag::name();
    if (state_->confirmed.has_error()) return make_exceptional_future<detail::ResultOf<M>>(state_->confirmed.error());
    return detail::call_remote<detail::ResultOf<M>, typename Tag::Wire>(
        state_->owner, name, detail::signature_of<typename Tag::Wire>(), options, state_->id, std::forward<A>(args)...);
  }
  /// `rpc_async<M>(args...).wait()`: blocks until the member's result arrives, and returns it or throws its error.
  /// UsageError on a corpc I/O thread.
  template <auto M, class... A>
  decltype(auto) rpc_sync(A&&... args) const {
    auto f = rpc_async<M>(std::forward<A>(args)...);
    if constexpr (std::is_void_v<detail::ResultOf<M>>) {
      f.wait();
    } else {
      return detail::ResultOf<M>(f.wait());
    }
  }
  /// Runs member M on the owner and keeps the result there: returns at once with a reference to it. Throws here the
  /// error of this reference's failed creation; other failures surface at the new reference's first use.
  template <auto M, class... A>
    requires(!detail::first_is_options<A...>)
  RRef<detail::ResultOf<M>> remote(A&&... args) const {
    return remote<M>(CallOptions{}, std::forward<A>(args)...);
  }
  /// As remote(args...), with options for the creation (its timeout bounds the owner's acknowledgement).
  template <auto M, class... A>
  RRef<detail::ResultOf<M>> remote(const CallOptions& options, A&&... args) const {
    if (state_->confirmed.has_error()) std::rethrow_exception(state_->confirmed.error());
    return detail::create_remote<detail::ResultOf<M>, detail::CreateFromMember<M>>(state_->owner, options, state_->id,
                                                                                   std::forward<A>(args)...);
  }

  /// @cond INTERNAL
  const std::shared_ptr<detail::RRefState>& state() const noexcept { return state_; }
  /// @endcond

 private:
  std::shared_ptr<detail::OwnerSlot> owner_slot() const {
    return state_->slot ? state_->slot : detail::RRefContext::get()->slot(state_->id);
  }
  std::shared_ptr<detail::RRefState> state_;
};

template <class T>
RRef<T> EnableRRefFromThis<T>::rref_from_this() const {
  auto slot = self_slot_.lock();
  if (!slot)
    throw UsageError("rref_from_this(): this " + std::string(type_name<T>()) +
                     " is not held by an RRef (create it with remote<T>, remote<&f> or RRef<T>(value))");
  // A new owner handle of the same value: counted while it lives, like any local reference.
  return RRef<T>(detail::RRefContext::get()->owner_handle(slot->id, detail::type_hash_of<T>()));
}

/// Creates F(args...) on worker `to` and returns a reference to the result at once; F runs on `to`'s worker pool
/// (and may return Task<R> or Future<R>: the reference is then to the R). Throws UnknownWorkerError or ShutdownError
/// here; every other failure (F threw, the creation timed out, `to` died) surfaces at the reference's first use.
template <auto F, class... A>
  requires(!detail::first_is_options<A...>)
RRef<detail::ResultOf<F>> remote(const WorkerRef& to, A&&... args) {
  return detail::create_remote<detail::ResultOf<F>, detail::CreateCall<F>>(to, CallOptions{}, std::forward<A>(args)...);
}
/// As remote<F>(to, args...), with options for the creation (its timeout bounds the owner's acknowledgement).
template <auto F, class... A>
RRef<detail::ResultOf<F>> remote(const WorkerRef& to, const CallOptions& options, A&&... args) {
  return detail::create_remote<detail::ResultOf<F>, detail::CreateCall<F>>(to, options, std::forward<A>(args)...);
}

/// Constructs a T(args...) on worker `to` (on its worker pool) and returns a reference to it at once; errors as for
/// remote<F>.
template <class T, class... A>
  requires(!detail::first_is_options<A...>)
RRef<T> remote(const WorkerRef& to, A&&... args) {
  return detail::create_remote<T, detail::CreateObject<T, std::decay_t<A>...>>(to, CallOptions{}, std::forward<A>(args)...);
}
/// As remote<T>(to, args...), with options for the creation.
template <class T, class... A>
RRef<T> remote(const WorkerRef& to, const CallOptions& options, A&&... args) {
  return detail::create_remote<T, detail::CreateObject<T, std::decay_t<A>...>>(to, options, std::forward<A>(args)...);
}

/// @cond INTERNAL
// On the wire: ids, owner, fork and sender; sharing follows the protocol in corpc/rref/context.hpp.
template <class T>
struct Codec<RRef<T>> {
  static void write(Writer& w, const RRef<T>& r) {
    if (!r.valid()) throw UsageError("cannot send an empty RRef");
    // A reference whose creation failed (timed out, refused) is passed on as that failure, not as a dangling fork.
    if (r.state()->confirmed.has_error()) std::rethrow_exception(r.state()->confirmed.error());
    auto ctx = detail::RRefContext::get();
    ForkId fork = ctx->fork_for(r.state(), w.peer);
    w.put(r.state()->id);
    w.put(fork);
    w.put(static_cast<std::int32_t>(r.state()->owner));
    w.put(static_cast<std::int32_t>(ctx->self()));
    w.put(detail::type_hash_of<T>());
  }
  static RRef<T> read(Reader& r) {
    auto id = r.get<RRefId>();
    auto fork = r.get<ForkId>();
    auto owner = r.get<std::int32_t>();
    auto sender = r.get<std::int32_t>();
    auto hash = r.get<std::uint64_t>();
    if (hash != detail::type_hash_of<T>())
      throw ArgumentTypeError("received an RRef of another type than RRef<" + std::string(type_name<T>()) + ">");
    auto ctx = detail::RRefContext::get();
    if (owner < 0 || owner >= Runtime::get().world_size() || sender != r.peer) throw ProtocolError("malformed RRef");
    return RRef<T>(ctx->receive(id, fork, owner, sender, hash));
  }
};
/// @endcond

}  // namespace corpc
