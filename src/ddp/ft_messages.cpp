#include "ddp/ft_messages.hpp"

#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

namespace corpc::ddp::ft_detail {

namespace {

// "{{1, 3}, {2, 4}}", as the options are written in C++.
std::string groups_text(const std::vector<std::vector<int>>& groups) {
  std::string out = "{";
  for (size_t g = 0; g < groups.size(); ++g) {
    out += g ? ", {" : "{";
    for (size_t k = 0; k < groups[g].size(); ++k) out += (k ? ", " : "") + std::to_string(groups[g][k]);
    out += "}";
  }
  return out + "}";
}

std::string shape_text(const std::vector<std::vector<int>>& groups) {
  return std::to_string(groups.size()) + " replica(s) of " + std::to_string(groups.front().size()) + " worker(s) (" +
         groups_text(groups) + ")";
}

}  // namespace

std::string worker_text(int rank) {
  const std::string r = "rank " + std::to_string(rank);
  if (auto* rt = Runtime::try_get()) {
    try {
      return "worker '" + rt->worker(rank).name + "' (" + r + ")";
    } catch (const RpcError&) {  // not a rank of this job: said as it is
    }
  }
  return "worker of " + r;
}

std::string workers_text(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += (out.empty() ? "" : ", ") + worker_text(r);
  return out;
}

std::string not_committed(std::int64_t step, const std::string& cause) {
  return "step " + std::to_string(step) + " was not committed: " + cause;
}

std::string attempt_failure(const std::string& why_not, const std::string& error) {
  // Said once: the coordinator's reason quotes a member's own error, and an aborted pipeline worker's quotes it.
  if (error.empty() || why_not.find(error) != std::string::npos || error.find(why_not) != std::string::npos)
    return why_not;
  return why_not + " (on " + worker_text(Runtime::get().rank()) + ": " + error + ")";
}

std::string replica_groups_mismatch(int coordinator_rank, const std::vector<std::vector<int>>& coordinator_groups,
                                    int trainer_rank, const std::vector<std::vector<int>>& trainer_groups) {
  if (coordinator_groups == trainer_groups) return "";
  std::string text =
      "fault-tolerant training: the QuorumCoordinator on " + worker_text(coordinator_rank) + " was made ";
  text +=
      coordinator_groups.empty() ? "without replica_groups" : "with replica_groups " + groups_text(coordinator_groups);
  text += ", but " + worker_text(trainer_rank) + " trains ";
  text += trainer_groups.empty() ? "as a replica of its own (FaultTolerantDdp)"
                                 : "in " + shape_text(trainer_groups) + ", as PipelineReplicas does";
  text += ": the coordinator and the trainers must agree on replica groups; ";
  if (trainer_groups.empty()) return text + "make the coordinator without replica_groups";
  return text +
         "make the coordinator with QuorumCoordinator({.replica_groups = layout.replica_groups()}), where layout "
         "is layout_of(options) of the trainers' PipelineReplicaOptions";
}

}  // namespace corpc::ddp::ft_detail
