// The words of fault-tolerant training's errors (corpc/ddp/fault_tolerant.hpp, corpc/ddp/pipeline_replicas.hpp): a
// worker is always named the same way, by its name and its RPC rank (never by its place among the members, which
// changes with every epoch), and a step that was not committed always says which step, why, and whose doing it was.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace corpc::ddp::ft_detail {

// "worker 'NAME' (rank R)"; "worker of rank R" where this process does not know the rank's name.
std::string worker_text(int rank);

// worker_text of each, joined with ", ".
std::string workers_text(const std::vector<int>& ranks);

// "step S was not committed: CAUSE", where CAUSE names the worker(s) it concerns with worker_text.
std::string not_committed(std::int64_t step, const std::string& cause);

// What a member reports of an attempt that was not committed: the coordinator's `why_not` (not_committed), and this
// member's own `error` where that says more (it is often a consequence, such as a collective cut by the lost worker).
std::string attempt_failure(const std::string& why_not, const std::string& error);

// Why a trainer whose replica groups are `trainer_groups` (empty: a replica of its own, as FaultTolerantDdp trains)
// cannot take part under a coordinator made with `coordinator_groups`, with the fix; "" if they agree.
std::string replica_groups_mismatch(int coordinator_rank, const std::vector<std::vector<int>>& coordinator_groups,
                                    int trainer_rank, const std::vector<std::vector<int>>& trainer_groups);

}  // namespace corpc::ddp::ft_detail
