// The definitions of RRef's members and of EnableRRefFromThis::rref_from_this. Part of corpc/rref/rref.hpp, which
// includes it after the declarations; kept apart so that the public header reads as their documentation.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace corpc {

template <class T>
RRef<T>::RRef(T value) {
  auto ctx = detail::RRefContext::get();
  auto id = ctx->new_id();
  auto slot = ctx->slot(id);
  state_ = ctx->owner_handle(id, detail::type_hash_of<T>());
  ctx->claim(slot);
  auto stored = std::make_shared<T>(std::move(value));
  detail::SelfBinder::bind(*stored, slot);
  ctx->fulfil(slot, std::move(stored), detail::type_hash_of<T>());
}

template <class T>
T& RRef<T>::local_value() const {
  if (!is_owner()) throw UsageError("local_value() on a user reference: the value lives on '" + owner_name() + "'");
  auto slot = owner_slot();
  if (!slot->ready.done()) throw UsageError("local_value(): the value is still being computed; await to_here()");
  return *detail::slot_value<T>(*slot);
}

template <class T>
Future<T> RRef<T>::to_here(CallOptions options) const {
  if (is_owner()) {
    auto slot = owner_slot();
    return slot->ready.then([slot] { return *detail::slot_value<T>(*slot); });
  }
  if (state_->confirmed.has_error()) return make_exceptional_future<T>(state_->confirmed.error());
  if constexpr (Encodable<T>) {
    (void)detail::AutoRegistered<&detail::rref_fetch<T>>::value;
    return detail::call_remote<T, std::tuple<detail::RRefId>>(state_->owner, function_name<&detail::rref_fetch<T>>(),
                                                              detail::signature_of<std::tuple<detail::RRefId>>(),
                                                              options, state_->id);
  } else {
    return make_exceptional_future<T>(
        std::make_exception_ptr(UsageError("to_here(): " + std::string(type_name<T>()) +
                                           " cannot be sent (no corpc::Codec); call its methods through the RRef")));
  }
}

template <class T>
template <auto M, class... A>
Future<detail::ResultOf<M>> RRef<T>::rpc_async(const CallOptions& options, A&&... args) const {
  using Tag = detail::InvokeMember<M>;
  static_assert(std::is_base_of_v<typename detail::FnTraits<decltype(M)>::Class, T>, "M is not a member of T");
  (void)detail::AutoEntry<Tag>::value;
  static const std::string name = Tag::name();
  if (state_->confirmed.has_error()) return make_exceptional_future<detail::ResultOf<M>>(state_->confirmed.error());
  return detail::call_remote<detail::ResultOf<M>, typename Tag::Wire>(
      state_->owner, name, detail::signature_of<typename Tag::Wire>(), options, state_->id, std::forward<A>(args)...);
}

template <class T>
template <auto M, class... A>
RRef<detail::ResultOf<M>> RRef<T>::remote(const CallOptions& options, A&&... args) const {
  if (state_->confirmed.has_error()) std::rethrow_exception(state_->confirmed.error());
  return detail::create_remote<detail::ResultOf<M>, detail::CreateFromMember<M>>(state_->owner, options, state_->id,
                                                                                 std::forward<A>(args)...);
}

template <class T>
std::shared_ptr<detail::OwnerSlot> RRef<T>::owner_slot() const {
  return state_->slot ? state_->slot : detail::RRefContext::get()->slot(state_->id);
}

template <class T>
RRef<T> EnableRRefFromThis<T>::rref_from_this() const {
  auto slot = self_slot_.lock();
  if (!slot)
    throw UsageError("rref_from_this(): this " + std::string(type_name<T>()) +
                     " is not held by an RRef (create it with remote<T>, remote<&f> or RRef<T>(value))");
  // A new owner handle of the same value: counted while it lives, like any local reference.
  return RRef<T>(detail::RRefContext::get()->owner_handle(slot->id, detail::type_hash_of<T>()));
}

}  // namespace corpc
