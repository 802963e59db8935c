// An RRef as an argument or a result. Part of corpc/rref/rref.hpp, which includes it after RRef.
#pragma once

#include <cstdint>
#include <string>

#include "corpc/rref/detail/context.hpp"
#include "corpc/rref/detail/owner.hpp"

namespace corpc {

/// @cond INTERNAL
// On the wire: ids, owner, fork and sender; sharing follows the protocol in corpc/rref/context.hpp.
template <class T>
struct Codec<RRef<T>> {
  static void write(Writer& w, const RRef<T>& r) {
    if (!r.valid()) throw UsageError("cannot send an empty RRef");
    // A reference whose creation failed (timed out, refused) is passed on as that failure, not as a dangling fork.
    if (r.state()->confirmed.has_error()) std::rethrow_exception(r.state()->confirmed.error());
    auto ctx = detail::RRefContext::get();
    detail::ForkId fork = ctx->fork_for(r.state(), w.peer);
    w.put(r.state()->id);
    w.put(fork);
    w.put(static_cast<std::int32_t>(r.state()->owner));
    w.put(static_cast<std::int32_t>(ctx->self()));
    w.put(detail::type_hash_of<T>());
  }
  static RRef<T> read(Reader& r) {
    auto id = r.get<detail::RRefId>();
    auto fork = r.get<detail::ForkId>();
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
