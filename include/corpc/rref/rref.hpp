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
#include "corpc/rref/detail/context.hpp"

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
inline constexpr bool serialized_calls_v = requires {
  requires T::corpc_serialized_calls;
};

}  // namespace corpc

// What RRef and remote() are built on: the owner's side of a value, and the requests that reach it.
#include "corpc/rref/detail/owner.hpp"
#include "corpc/rref/detail/requests.hpp"

namespace corpc {

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
  explicit RRef(T value);
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
  T& local_value() const;

  /// A copy of the value, fetched from the owner (no copy on the owner itself). Awaitable; `.wait()` blocks. Waits on
  /// the owner until the value has been computed. A `T` without a Codec cannot travel: its future fails with
  /// UsageError (call its methods through rpc_async instead).
  Future<T> to_here(CallOptions options = {}) const;

  /// Runs member M of the remote object on its owner: rref.rpc_async<&T::method>([options,] args...). Returns at
  /// once; on the owner the call waits for the value to exist, then runs on the worker pool (one at a time when
  /// serialized_calls_v<T>). Errors as for corpc::rpc_async, on the future.
  template <auto M, class... A>
    requires(!detail::first_is_options<A...>)
  Future<detail::ResultOf<M>> rpc_async(A&&... args)
  const { return rpc_async<M>(CallOptions{}, std::forward<A>(args)...); }
  /// As rpc_async(args...), with per-call options (with_timeout, with_stop_token).
  template <auto M, class... A>
  Future<detail::ResultOf<M>> rpc_async(const CallOptions& options, A&&... args) const;
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
  RRef<detail::ResultOf<M>> remote(A&&... args)
  const { return remote<M>(CallOptions{}, std::forward<A>(args)...); }
  /// As remote(args...), with options for the creation (its timeout bounds the owner's acknowledgement).
  template <auto M, class... A>
  RRef<detail::ResultOf<M>> remote(const CallOptions& options, A&&... args) const;

  /// @cond INTERNAL
  const std::shared_ptr<detail::RRefState>& state() const noexcept { return state_; }
  /// @endcond

 private:
  std::shared_ptr<detail::OwnerSlot> owner_slot() const;
  std::shared_ptr<detail::RRefState> state_;
};

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
  return detail::create_remote<T, detail::CreateObject<T, std::decay_t<A>...>>(to, CallOptions{},
                                                                               std::forward<A>(args)...);
}
/// As remote<T>(to, args...), with options for the creation.
template <class T, class... A>
RRef<T> remote(const WorkerRef& to, const CallOptions& options, A&&... args) {
  return detail::create_remote<T, detail::CreateObject<T, std::decay_t<A>...>>(to, options, std::forward<A>(args)...);
}

}  // namespace corpc

// The definitions of the members above, and an RRef as an argument or a result.
#include "corpc/rref/detail/codec.hpp"
#include "corpc/rref/detail/rref_members.hpp"
