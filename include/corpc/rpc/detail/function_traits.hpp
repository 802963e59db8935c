// corpc/rpc/detail/function_traits.hpp — what a callable's signature means on the wire.
#pragma once

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "corpc/core/future.hpp"
#include "corpc/core/task.hpp"
#include "corpc/core/type_name.hpp"

namespace corpc::detail {

// A function's declared result, and what the caller receives: Task<T> and Future<T> results arrive as T.
template <class R>
struct Unwrap {
  using type = R;
  static constexpr bool is_task = false, is_future = false;
};
template <class T>
struct Unwrap<Task<T>> {
  using type = T;
  static constexpr bool is_task = true, is_future = false;
};
template <class T>
struct Unwrap<Future<T>> {
  using type = T;
  static constexpr bool is_task = false, is_future = true;
};

template <class F>
struct FnTraits;

template <class R, class... A>
struct FnTraits<R (*)(A...)> {
  using Result = R;
  using Params = std::tuple<A...>;
  using Args = std::tuple<std::decay_t<A>...>;
  using Class = void;
};
template <class R, class... A>
struct FnTraits<R (*)(A...) noexcept> : FnTraits<R (*)(A...)> {};

#define CORPC_MEMBER_TRAITS(QUALS)               \
  template <class R, class C, class... A>        \
  struct FnTraits<R (C::*)(A...) QUALS> {        \
    using Result = R;                            \
    using Params = std::tuple<A...>;             \
    using Args = std::tuple<std::decay_t<A>...>; \
    using Class = C;                             \
  };
CORPC_MEMBER_TRAITS()
CORPC_MEMBER_TRAITS(const)
CORPC_MEMBER_TRAITS(noexcept)
CORPC_MEMBER_TRAITS(const noexcept)
#undef CORPC_MEMBER_TRAITS

template <auto F>
using ResultOf = typename Unwrap<typename FnTraits<decltype(F)>::Result>::type;

// The signature key: a hash of the decayed parameter types, so that a caller and callee that disagree get a clear
// ArgumentTypeError instead of misread bytes. Computed at compile time (every call sends it).
template <class ArgsTuple>
consteval std::uint64_t signature_of() {
  return fnv1a(type_name<ArgsTuple>());
}

// Forwards a decoded argument to a parameter of type P: lvalue-reference parameters see the stored object, the rest
// take it by move.
template <class P, class T>
decltype(auto) forward_param(T& stored) {
  if constexpr (std::is_lvalue_reference_v<P>) {
    return (stored);
  } else {
    return std::move(stored);
  }
}

}  // namespace corpc::detail
