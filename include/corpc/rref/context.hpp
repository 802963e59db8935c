/// @file
/// The bookkeeping behind RRef: who owns what, who still refers to it.
///
/// Protocol (PyTorch's, made explicit). Every value has one owner; other workers hold user references, each one a
/// *fork* with its own id. The owner keeps the value while any fork or any local handle exists.
///   - Sharing an RRef R (owner O) from S to D allocates a fork F. If S is O, O records F (held by D) at once.
///     Otherwise S keeps R alive in `pending_children` until O accepts F (guarantee G2: a parent outlives the
///     owner's confirmation of its child). D, if it is not O, asks O to record F (fork request); O records it,
///     answers D (D's reference is now *confirmed*) and tells S (child accepted). If D is O, O tells S directly.
///   - When the last handle of a user reference goes, its worker tells O (guarantee G1), once confirmed.
///   - Control messages are idempotent and assume no ordering: a message about a value the owner has not created yet
///     makes an empty slot that the creation fills.
///   - Worker death: an owner drops forks held by a dead worker (so a dead user never pins a value for ever), and a
///     sender drops pending children bound for it; users of a dead owner fail every use with ConnectionError.
#pragma once

#include <cstdint>

#include "corpc/core/future.hpp"
#include "corpc/rpc/worker_info.hpp"
#include "corpc/wire/codec.hpp"

namespace corpc {

/// This worker's RRef counts: diagnostics for users (as PyTorch's `_rref_context_get_debug_info()`) and tests.
struct RRefStats {
  std::uint64_t owned_values = 0;     ///< values this worker owns (created or placeholder)
  std::uint64_t user_references = 0;  ///< live user references held here
  std::uint64_t pending_forks = 0;    ///< children not yet accepted by their owner + unconfirmed user references
  CORPC_FIELDS(owned_values, user_references, pending_forks)
};

/// This worker's RRef counts; `rref_stats(worker)` asks another worker.
RRefStats rref_stats();
/// Worker `worker`'s RRef counts, by RPC (errors as for rpc_async, on the future).
Future<RRefStats> rref_stats(const WorkerRef& worker);

}  // namespace corpc
