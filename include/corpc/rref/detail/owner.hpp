// The owner's side of an RRef: values kept in owner slots, read back as their type, members called on them. Part of
// corpc/rref/rref.hpp, which includes it after the declarations it uses (EnableRRefFromThis, serialized_calls_v).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <variant>

#include "corpc/rpc/call.hpp"
#include "corpc/rref/detail/context.hpp"

namespace corpc::detail {

// Links an object that derives from EnableRRefFromThis to the owner slot that holds it.
struct SelfBinder {
  template <class T>
  static void bind(T& object, const std::shared_ptr<OwnerSlot>& slot) {
    if constexpr (std::is_base_of_v<EnableRRefFromThis<T>, T>) object.EnableRRefFromThis<T>::self_slot_ = slot;
  }
};

template <class T>
consteval std::uint64_t type_hash_of() {
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
    return [&]<std::size_t... I>(std::index_sequence<I...>)->decltype(auto) {
      return ((*obj).*M)(forward_param<std::tuple_element_t<I, typename Tr::Params>>(std::get<I>(args))...);
    }
    (std::make_index_sequence<std::tuple_size_v<Args>>{});
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

}  // namespace corpc::detail
