/// @file
/// Pipeline × data parallelism that trains through a lost worker: R replicas of a K-stage pipeline, each on its own
/// share of every batch, each stage's gradients averaged over the R workers that hold it, one step at a time under
/// the quorum of fault-tolerant DDP (corpc/ddp/fault_tolerant.hpp), which now counts whole replicas.
///
/// ```cpp
///   corpc::ddp::PipelineReplicaOptions o;
///   o.replicas = 2;                                       // R
///   o.balance = {3, 3};                                   // K = 2 stages: layers per stage
///   o.schedule = corpc::pipeline::Schedule::OneFOneB;     // any of the eight; 1F1B: one stage per worker
///   o.micro_batches = 4;
///   const auto layout = corpc::ddp::layout_of(o);         // ranks 1..4 train (R × W workers), rank 0 coordinates
///   corpc::launch_processes(1 + layout.world(), [&](int rank) {
///     corpc::init_rpc("rank" + std::to_string(rank));     // a restarted worker rejoins (CORPC_REJOIN=1)
///     if (rank == 0) {
///       corpc::ddp::QuorumCoordinator coordinator({.replica_groups = layout.replica_groups()});
///       corpc::shutdown();
///       return;
///     }
///     corpc::ddp::PipelineReplicas pp(make_model(/*seed=*/0), &mse, &make_sgd, o);   // the same model everywhere
///     while (pp.committed_steps() < 500)
///       pp.step([](std::int64_t step, int replica) { return batch(step, replica); });   // (inputs, targets)
///     corpc::shutdown();
///   }, {.max_rank_restarts = 10});                        // a killed worker is started again in place
/// ```
///
/// **Ranks.** As torchtitan's device mesh with the pipeline dimension outermost: the worker at position p of replica
/// r is rank `first_rank + p·R + r` (ReplicaLayout). A stage's R copies sit on consecutive ranks, so with ranks packed
/// onto hosts in order the averaging of a stage, the heaviest traffic (every gradient), stays inside a host, and only
/// one activation per micro-batch crosses hosts. The price: losing a host loses a stage of several replicas at once.
/// With W workers per replica (W = K / v, v stages per worker as the schedule places them: 1 for GPipe, 1F1B, ZB-H1;
/// 2 for ZBV, DualPipeV and, by default, the interleaved ones) the job has 1 + R·W processes.
///
/// **A step.** Every worker runs its own action list (corpc/pipeline/schedule.hpp) over the stages it hosts, with
/// activations and gradients sent straight between a replica's workers; the worker of the first stage takes its
/// replica's inputs from `batch(step, replica)`, the last stage's worker its targets. When a stage's last backward
/// (its last B, or W under zero bubble) is done, its gradients are averaged over the stage's R copies through a Gloo
/// group of its own (bucketed as DDP's, GradientSync), while the worker goes on with its other stages' work. Each
/// stage has its own group because workers reorder their actions at run time: two stages on one worker can finish in
/// a different order on different replicas. The optimizers step when the step is committed.
///
/// **Faults.** A replica takes part in a step as a whole or not at all. If any of its workers dies or stalls, the
/// coordinator tells every member that the attempt is taken by nobody (a worker waiting for a lost mate's activation
/// stops at once), the survivors vote it down and run the same step again with the other replicas only, without
/// restarting, and the stage averages are over the replicas that took part. No worker ever applies a step another
/// did not. The launcher restarts the lost worker in place; the live workers of its replica wait in the coordinator
/// until it is back, and then each worker of that replica loads its stages' parameters, buffers, optimizer states and
/// the step counter from the worker at the same position of a live replica (no checkpoint is read) and the replica
/// rejoins at the next step. What is not recovered: anything else the dead process held (RRefs it owned, distributed
/// autograd contexts, its RNG state, a data loader's position: seek it in FaultTolerantOptions::on_recovered).
/// A restarted worker's replica comes back only while some live replica holds the state at each position.
///
/// **Checkpoints.** save_checkpoint writes the last committed step, one file per stage, while training goes on;
/// load_checkpoint starts a job (any number of replicas, the same cut) from one, and load_replica_checkpoint loads
/// one into a whole model in one process (corpc/ddp/replica_checkpoint.hpp).
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "corpc/ddp/quorum.hpp"
#include "corpc/pipeline/pipeline.hpp"

namespace corpc::ddp {

/// How pipeline replicas are trained (see corpc/ddp/pipeline_replicas.hpp).
struct PipelineReplicaOptions {
  int replicas = 2;          ///< R: copies of the pipeline, each on its own share of every batch
  std::vector<int> balance;  ///< consecutive layers per stage; its size is K, the number of stages
  pipeline::Schedule schedule = pipeline::Schedule::OneFOneB;  ///< every replica's schedule
  int stages_per_worker = 0;  ///< v; 0: the fewest the schedule runs (pipeline::min_stages_per_worker)
  int micro_batches = 4;      ///< M: each replica's share of a batch is cut into this many micro-batches
  pipeline::LossReduction loss_reduction = pipeline::LossReduction::mean;  ///< as PipelineOptions::loss_reduction
  int first_rank = 1;  ///< the workers are ranks first_rank .. first_rank + R·W - 1
  /// false: fixed groups and no quorum (a lost worker fails every worker's step with its error): the same training
  /// without the cost of fault tolerance.
  bool fault_tolerant = true;
  FaultTolerantOptions ft;  ///< the coordinator's rank, timeouts, retries, the averaging's buckets (ft.ddp)
  /// Called on this worker after each action of an attempt (fault injection: a test or the example's --kill); after
  /// a stage's last backward, once its averaging has started.
  std::function<void(std::int64_t step, const pipeline::Action& done)> after_action;
  /// Called on this worker when a stage's gradients are complete, before their averaging starts (fault injection).
  std::function<void(std::int64_t step, int stage)> before_averaging;
};

/// Which rank is which worker of which replica: the pipeline dimension outermost (see the top of this header).
struct ReplicaLayout {
  int replicas = 1;             ///< R
  int workers_per_replica = 1;  ///< W
  int first_rank = 1;           ///< the first worker's RPC rank
  /// The worker at `position` (0..W-1, in pipeline order) of `replica`.
  int rank(int replica, int position) const { return first_rank + position * replicas + replica; }
  int replica_of(int rank) const { return (rank - first_rank) % replicas; }   ///< a worker's replica
  int position_of(int rank) const { return (rank - first_rank) / replicas; }  ///< a worker's place in its replica
  int world() const { return replicas * workers_per_replica; }                ///< R·W workers
  /// Each replica's ranks in position order: QuorumOptions::replica_groups for the coordinator.
  std::vector<std::vector<int>> replica_groups() const;
};

/// The layout `options` gives (UsageError for a balance and schedule that do not fit).
ReplicaLayout layout_of(const PipelineReplicaOptions& options);

/// A replica's share of one step's batch: (inputs, targets), each cut along dimension 0 into the micro-batches.
/// Called on the workers of the first and the last stage; it must give the same tensors for the same arguments
/// wherever it is called (a retried step, a restarted worker).
using ReplicaBatchFn = std::function<std::pair<at::Tensor, at::Tensor>(std::int64_t step, int replica)>;

/// What one PipelineReplicas::step did, on this worker.
struct ReplicaStepReport {
  StepReport ft;                  ///< the committed attempt's quorum (RPC ranks), retries, recovery
  std::vector<int> replicas;      ///< the replicas that took part in the committed step
  std::optional<double> loss;     ///< this replica's loss, on the worker of the last stage
  pipeline::WorkerReport worker;  ///< this worker's actions in the committed attempt (timeline.hpp)
  /// One stage's averaging over the replicas, on the clock of `worker`'s records (trace::now_ns).
  struct Averaging {
    int stage = 0;                 ///< the stage
    std::int64_t started_ns = 0;   ///< when it started: the stage's last backward was done
    std::int64_t finished_ns = 0;  ///< when the averages were in the stage's gradients
  };
  /// The averaging of each stage this worker holds, in the committed attempt (none while one replica trains alone).
  /// One that started before `worker`'s last action ended overlapped this worker's other work.
  std::vector<Averaging> averaging;
};

/// One stage this worker holds.
struct ReplicaStage {
  int stage = 0;                                 ///< its index in the pipeline
  torch::nn::Sequential layers;                  ///< its layers (their parameters are trained in place)
  torch::optim::Optimizer* optimizer = nullptr;  ///< its optimizer
};

/// One worker of R pipeline replicas (see corpc/ddp/pipeline_replicas.hpp). Every worker constructs one after
/// init_rpc, with the same model, options and functions; a QuorumCoordinator with the layout's replica groups runs on
/// `options.ft.coordinator_rank` (without fault tolerance, that rank serves the groups' store only): a worker made
/// under a coordinator with other replica groups, or none, is refused (UsageError naming the fix). Like
/// FaultTolerantDdp it sets SIGPIPE to ignored unless the program installed a handler.
class PipelineReplicas {
 public:
  /// Keeps the stages of `model` (the whole model, built alike on every worker: seed it) that this worker's place
  /// holds; `loss` runs on the last stage's worker, `make_optimizer` once per stage held. UsageError if the options
  /// do not fit the job (this rank is no worker, too few ranks, a schedule that does not fit), if the coordinator's
  /// replica groups are not the layout's (asked of it, waiting up to ft.quorum_timeout for it to be made), or if a
  /// fault-tolerant trainer runs in this process already.
  PipelineReplicas(torch::nn::Sequential model, pipeline::LossFn loss, pipeline::OptimizerFactory make_optimizer,
                   PipelineReplicaOptions options);
  ~PipelineReplicas();
  PipelineReplicas(const PipelineReplicas&) = delete;
  PipelineReplicas& operator=(const PipelineReplicas&) = delete;

  /// One training step: (fault tolerant) the quorum, and recovery if this worker's replica needs it; this worker's
  /// actions over its stages on its replica's share of `batch`; each stage's gradients averaged over the replicas
  /// that take part; the vote; and, committed, the optimizer steps. A failed attempt runs again with a new quorum (up
  /// to ft.max_retries times, then its error is thrown). Collective: every worker calls it in a loop.
  ReplicaStepReport step(const ReplicaBatchFn& batch);

  std::int64_t committed_steps() const;      ///< steps committed (a recovered worker's count is its donor's)
  const ReplicaLayout& layout() const;       ///< where every worker is
  int replica() const;                       ///< this worker's replica
  int position() const;                      ///< this worker's place in its replica
  std::vector<ReplicaStage> stages() const;  ///< the stages this worker holds, in pipeline order

  /// Saves the state of the last committed step under `root` (corpc/ddp/replica_checkpoint.hpp): on the workers of
  /// the lowest replica that took part in it, each stage's file of root/step-N, its layers and optimizer state copied
  /// now and written on a thread of its own while training goes on; the other workers write nothing. Call it on every
  /// worker after a step (before any step nothing is written). Waits for this worker's previous write first, and
  /// throws its error if it failed. Returns root/step-N.
  std::string save_checkpoint(const std::string& root);
  /// Waits for this worker's write in flight, if any; throws its error if it failed. (The destructor waits too.)
  void wait_checkpoint();
  /// Loads the stages this worker holds, optimizer state included, and the step counter from `step_dir` (a step
  /// directory save_checkpoint wrote, e.g. latest_replica_checkpoint(root)); on every worker, before the first
  /// step. The checkpoint's job may have had another number of replicas or another schedule, but the same cut (its
  /// optimizer states are per stage). Returns the step. UsageError, with nothing loaded, after a step, for another
  /// cut or other shapes, a stage file that is missing, or an optimizer state that this job's optimizer cannot load
  /// (another kind of optimizer saved it).
  std::int64_t load_checkpoint(const std::string& step_dir);

  /// @cond INTERNAL
  struct State;
  /// @endcond

 private:
  std::shared_ptr<State> state_;
};

}  // namespace corpc::ddp
