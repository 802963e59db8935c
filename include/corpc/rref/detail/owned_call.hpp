// Calling a member of an object this process owns through its RRef without a message to itself. A caller that
// holds many RRefs and owns some of them (DistributedOptimizer: one optimizer per owner) calls its own on the
// calling thread, which is cheaper than a request to itself and runs after its requests to the other owners have
// left.
#pragma once

#include <memory>
#include <tuple>
#include <utility>

#include "corpc/core/detail/deferred_work.hpp"
#include "corpc/core/executor.hpp"
#include "corpc/core/task.hpp"
#include "corpc/rref/rref.hpp"

namespace corpc::detail {

// A callable taking M's arguments that calls M on `ref`'s object, which this process must own. On a thread that may
// block it sends what this thread staged first (the requests to other owners leave before it computes), then runs M
// here; on an I/O thread it sends the call to this process as rpc_async does, so that no computation lands there.
// Calls through one RRef run one at a time either way: both go through the owner's slot.
template <auto M, class T>
auto owned_member_call(const RRef<T>& ref) {
  std::shared_ptr<OwnerSlot> slot = RRefContext::get()->slot(ref.state()->id);
  return [ref, slot](auto... args) -> Future<ResultOf<M>> {
    if (blocking_forbidden()) return ref.template rpc_async<M>(std::move(args)...);
    run_deferred_work();
    return spawn(invoke_member<M>(slot, std::tuple<decltype(args)...>(std::move(args)...)));
  };
}

}  // namespace corpc::detail
