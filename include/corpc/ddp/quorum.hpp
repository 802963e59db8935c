/// @file
/// The quorum that fault-tolerant training runs under: the coordinator that decides each step's members and commits
/// it (QuorumCoordinator, QuorumOptions, QuorumStats), and what a trainer sees of it (Quorum, FaultTolerantOptions,
/// StepReport). Shared by fault-tolerant DDP (corpc/ddp/fault_tolerant.hpp, which describes a step, recovery and
/// liveness) and pipeline replicas (corpc/ddp/pipeline_replicas.hpp, whose replicas take part as wholes).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "corpc/ddp/ddp.hpp"  // DdpOptions: the DistributedDataParallel of each epoch

namespace corpc::ddp {

/// How the coordinator forms each step's quorum (see corpc/ddp/fault_tolerant.hpp).
struct QuorumOptions {
  /// The trainers: the members of the first quorum, waited for up to `startup_timeout`. Empty: every RPC rank but
  /// the coordinator's.
  std::vector<int> replicas;
  /// Ranks that take part only together, one list per replica, position by position (the workers of a pipeline
  /// replica: corpc/ddp/pipeline_replicas.hpp). A quorum then has whole replicas only: the requests of a replica with
  /// a rank missing wait for a later round, a member recovers from one at its own position, and when a step fails
  /// the members are told at once. Empty: every rank is a replica of its own. Sets `replicas` when that is empty.
  /// The trainers must agree: a trainer whose replicas are not these (PipelineReplicas under a coordinator made
  /// without them, FaultTolerantDdp under one made with them) is refused as it is made, with UsageError naming the
  /// fix.
  std::vector<std::vector<int>> replica_groups;
  /// A quorum needs at least this many replicas; below it the trainers wait (their request's own timeout bounds it).
  int min_replicas = 1;
  /// How long a quorum, once one member asks, waits for the other members of the last quorum (and a commit vote for
  /// the other members' votes) before it goes on without them.
  std::chrono::milliseconds join_timeout{std::chrono::seconds(3)};
  /// How long the first quorum waits for every replica (processes start at different speeds).
  std::chrono::milliseconds startup_timeout{std::chrono::seconds(60)};
};

/// What the coordinator has decided so far (on the coordinator's rank).
struct QuorumStats {
  std::int64_t epoch = 0;          ///< the current epoch (one per change of members, or per failed step)
  std::int64_t quorums = 0;        ///< quorums answered
  std::int64_t commits = 0;        ///< steps committed
  std::int64_t aborted_steps = 0;  ///< steps voted down (a member failed or was late)
  std::int64_t recoveries = 0;     ///< members told to load a donor's state
  std::vector<int> waiting;        ///< ranks whose quorum request waits in the open round
  std::vector<int> members;        ///< the current epoch's members
};

/// The quorum coordinator: on one rank (usually 0), after init_rpc. It answers the trainers' requests while it
/// lives; destroy it after the trainers are done (shutdown() waits for them first, so constructing it and calling
/// corpc::shutdown() is the usual body of that rank). One per process.
class QuorumCoordinator {
 public:
  /// Starts answering on this rank (after init_rpc); requests that came first are answered now. UsageError if one
  /// runs in this process already.
  explicit QuorumCoordinator(QuorumOptions options = {});
  /// Stops answering: requests still waiting fail with ShutdownError, open votes are not committed.
  ~QuorumCoordinator();
  QuorumCoordinator(const QuorumCoordinator&) = delete;
  QuorumCoordinator& operator=(const QuorumCoordinator&) = delete;

  QuorumStats stats() const;  ///< what it has decided so far, and who waits to join

  /// @cond INTERNAL
  struct State;
  /// @endcond

 private:
  std::shared_ptr<State> state_;
};

/// One step's quorum, as a member sees it.
struct Quorum {
  std::int64_t epoch = -1;   ///< the members' group: a new one whenever the members change or a step failed
  std::int64_t step = 0;     ///< the step the members run now (steps committed before it)
  std::vector<int> members;  ///< RPC ranks, ascending
  int recover_from = -1;     ///< for this rank: the member whose state it loads before the step, or -1
  /// This rank's place among the members (its rank in the epoch's group), or -1 if it is not one.
  int member_index() const;
  int member_count() const { return static_cast<int>(members.size()); }  ///< how many members there are
};

/// How a trainer takes part (see corpc/ddp/fault_tolerant.hpp).
struct FaultTolerantOptions {
  int coordinator_rank = 0;  ///< where the QuorumCoordinator runs (its RpcStore holds the epoch groups' keys)
  /// The epoch group's collective timeout: a member that hangs in an allreduce fails the step after this long.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(10)};
  /// How long a quorum request may wait (the coordinator's join and startup timeouts, and min_replicas, come first).
  std::chrono::milliseconds quorum_timeout{std::chrono::minutes(2)};
  /// How many times one step is run again after failing before step() gives up and throws.
  int max_retries = 3;
  DdpOptions ddp;  ///< the DistributedDataParallel of each epoch
  /// Runs on this rank after it loaded a donor's state and before it joins the step's group: the step counter is the
  /// donor's now (`quorum.step`), so a data loader can seek to it here.
  std::function<void(const Quorum& quorum)> on_recovered;
};

/// What one call of a trainer's step did (FaultTolerantDdp::step; PipelineReplicas::step's ReplicaStepReport::ft).
struct StepReport {
  Quorum quorum;           ///< the quorum of the attempt that was committed
  int retries = 0;         ///< attempts that failed before it
  bool recovered = false;  ///< this rank loaded a donor's state during this step
  /// Why the last failed attempt failed ("" if none did): "step S was not committed: " and the cause, naming the
  /// worker it concerns as "worker 'NAME' (rank R)" (lost, failed, or late to vote), then this rank's own error.
  std::string last_error;
};

}  // namespace corpc::ddp
