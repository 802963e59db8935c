/// @file
/// Pipeline parallelism: a torch::nn::Sequential cut into stages on other workers, each
/// worker running its schedule's list of actions (corpc/pipeline/schedule.hpp).
///
/// ```cpp
///   torch::nn::Sequential make_model(std::int64_t width, std::uint64_t seed);       // same weights wherever it is built
///   at::Tensor mse(const at::Tensor& out, const at::Tensor& target);                 // runs on the last stage's worker
///   std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params);  // one per stage, on its worker
/// ```
///
/// ```cpp
///   corpc::pipeline::PipelineOptions o;
///   o.workers = {"worker1", "worker2"};                       // 1F1B: stage s on workers[s]
///   o.balance = corpc::pipeline::balance_by_time(make_model(64, 0), sample, 2);  // layers per stage
///   o.schedule = corpc::pipeline::Schedule::OneFOneB;
///   o.micro_batches = 8;
///   auto pipe = corpc::pipeline::Pipeline::create<&make_model, &mse, &make_sgd>(o, std::int64_t{64}, std::uint64_t{0});
///   corpc::pipeline::StepResult r = co_await pipe.train_step(images, labels);   // r.loss, r.workers (timeline, memory)
/// ```
///
/// How a step runs. The caller cuts the batch into micro-batches and sends each worker its action list for the step
/// (the first stage's worker also gets the inputs, the last stage's the targets). A forward receives its activation
/// from the stage before (stage k's worker calls stage k+1's directly, never through the caller), runs the stage's
/// layers, keeps (input, output) for that micro-batch and sends the output on; the last stage computes the loss,
/// scaled by the micro-batch's share of the batch so that the gradients equal the whole batch's. A backward receives
/// the output's gradient, runs libtorch's autograd engine on the stage's own graph (torch::autograd::backward), sends
/// the input's gradient back, and drops the micro-batch: its activations are freed when its backward ends, which is
/// what lets 1F1B hold K-r micro-batches where GPipe holds M. When every action is done, each stage's optimizer steps
/// on its worker. No distributed autograd is involved.
///
/// Zero bubble splits a backward into I and W at the autograd nodes where an activation's gradient meets a weight (a
/// convolution, a batch norm, an addmm), as torch.distributed.pipelining does: I computes the input's gradient alone
/// and keeps the gradients that reach those nodes, W runs the engine from them to the parameters. No gradient is
/// computed twice, whatever a layer is made of. The first stage has no input gradient to send: its W runs its whole
/// backward. A micro-batch's graph is held from its F to its W, with those gradients from its I. A worker whose next
/// action's input has not arrived runs a later W whose I is done instead of waiting (a W sends nothing, so no other
/// worker's order changes); an overlapped pair (DualPipeV) starts with whichever of its inputs is there.
///
/// The loss: say how Loss reduces over the batch (PipelineOptions::loss_reduction). A mean (libtorch's default
/// reduction: MSE, cross-entropy) is the default, and each micro-batch's loss is scaled by its share of the batch; a
/// sum (`torch::kSum`) is not scaled. Either way StepResult::loss and the gradients are those of the whole batch in
/// one process. A wrong setting scales both by the number of micro-batches (or its inverse) without an error.
/// BatchNorm in training mode normalizes each micro-batch by itself, so results equal the unsplit model's only in
/// eval mode (`train(false)`).
///
/// Failure: if a stage's worker dies or a stage throws, the caller tells every other worker to abort the step (their
/// pending receives fail at once), and train_step fails with PipelineError naming the stage and worker.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "corpc/core/task.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/pipeline/balance.hpp"
#include "corpc/pipeline/detail/stages.hpp"
#include "corpc/pipeline/schedule.hpp"
#include "corpc/pipeline/timeline.hpp"
#include "corpc/rpc/call.hpp"

namespace corpc::pipeline {

/// The loss as the last stage's worker computes it from the model's output and the targets, reduced over the batch
/// as PipelineOptions::loss_reduction says.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
/// Makes one stage's optimizer, on its worker, over that stage's parameters.
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

/// How the Loss function reduces over a batch: a mean (libtorch's default reduction) or a sum.
enum class LossReduction { mean, sum };

/// Where the stages go and how a step is scheduled; checked by Pipeline::create.
struct PipelineOptions {
  /// "worker1" or "worker1/cpu" (the stage's device). The schedule's placement decides which stages each hosts
  /// (corpc/pipeline/schedule.hpp): in a loop, stage s runs on workers[s % workers.size()]; in a V (ZBV, DualPipeV)
  /// workers[r] holds stages r and 2K-1-r. With more stages than workers, each worker hosts several.
  std::vector<std::string> workers;
  std::vector<int> balance;                ///< consecutive layers per stage; its size is the number of stages
  Schedule schedule = Schedule::OneFOneB;  ///< the order of each worker's actions (corpc/pipeline/schedule.hpp)
  int micro_batches = 4;  ///< M: the batch is cut into this many micro-batches (fewer if the batch is smaller)
  /// A schedule given as data instead of `schedule`: custom_actions[i] is the action list of workers[i], e.g. from
  /// read_schedule_csv (a schedule made for torch.distributed.pipelining, or by a solver). Its stages go where its
  /// actions are; it fixes M (the highest micro-batch index + 1: micro_batches is ignored, and a batch must give that
  /// many). create() checks it before anything is built: every stage on one worker, every micro-batch's forward and
  /// backward (B, or I then W) once each, no deadlock (simulate_schedule), and the memory bound below.
  std::vector<std::vector<Action>> custom_actions;
  /// For custom_actions: the most micro-batches a worker may hold, counted in stages' activations (count_peak_held);
  /// 0 for no bound.
  int max_held_per_worker = 0;
  LossReduction loss_reduction = LossReduction::mean;  ///< how Loss reduces over the batch (see the top of this header)
};

/// The cut for `options` whose simulated step is shortest (balance_for_schedule, corpc/pipeline/schedule_balance.hpp):
/// for options.schedule on options.workers with options.micro_batches, `stages_per_worker` stages each (0: the fewest
/// the schedule runs, min_stages_per_worker), or for options.custom_actions when it is set (its stages: the highest
/// stage index + 1). `costs`: each layer's F, I and W seconds at the micro-batch size the pipeline runs
/// (profile_layer_costs). Set options.balance from the result's balance:
///
/// ```cpp
///   auto costs = corpc::pipeline::profile_layer_costs(model, micro_batch);  // a micro-batch-sized sample
///   o.balance = corpc::pipeline::balance_for_pipeline(o, costs).balance;
/// ```
inline ScheduleBalance balance_for_pipeline(const PipelineOptions& options, const std::vector<ActionCosts>& costs,
                                            int stages_per_worker = 0, double send_seconds = 0) {
  const int workers = static_cast<int>(options.workers.size());
  if (options.custom_actions.empty())
    return balance_for_schedule(costs, options.schedule, workers, options.micro_batches, stages_per_worker,
                                send_seconds);
  int stages = 0;
  for (auto& list : options.custom_actions)
    for (auto& a : list) stages = std::max(stages, a.stage + 1);
  return balance_for_plan(costs, options.custom_actions, stages, send_seconds);
}

/// The next cut for `options` from a real step with options.balance: calibrates `costs` with each stage's measured
/// F, I and W (calibrate_layer_costs), fits the time per message between workers to the step's span
/// (fit_send_seconds), and cuts again where the simulated step is shortest (balance_for_pipeline). A profile taken
/// one layer at a time can misjudge a running stage by a third or more, and by more in some stages than others;
/// rounds of this converge on what the running stages pay. `step`: a train_step's StepResult::workers, not the
/// first step of a Pipeline (that one pays for its allocations). Returns the same balance when the measured step
/// confirms it; a round can also overshoot, so keep the cut whose measured step was fastest:
///
/// ```cpp
///   auto costs = corpc::pipeline::profile_layer_costs(model, micro_batch);
///   o.balance = corpc::pipeline::balance_for_pipeline(o, costs).balance;
///   for (int round = 0; round < 3; ++round) {
///     auto pipe = Pipeline::create<&make_model, &loss, &make_optimizer>(o);
///     corpc::sync_wait(pipe.train_step(x, y));  // warm-up
///     auto step = corpc::sync_wait(pipe.train_step(x, y));
///     auto next = corpc::pipeline::refine_balance_for_pipeline(o, costs, step.workers);
///     if (next.balance == o.balance) break;
///     o.balance = next.balance;
///   }
/// ```
///
/// UsageError if options.balance is not a cut of `costs` into the stages of the step.
inline ScheduleBalance refine_balance_for_pipeline(const PipelineOptions& options, std::vector<ActionCosts>& costs,
                                                   const std::vector<WorkerReport>& step) {
  const int workers = static_cast<int>(options.workers.size());
  const int stages = static_cast<int>(options.balance.size());
  if (workers < 1 || stages % workers != 0)
    throw UsageError("refine_balance_for_pipeline: options.balance has " + std::to_string(stages) +
                     " stages, not a multiple of its " + std::to_string(workers) + " workers");
  const int per_worker = stages / workers;
  calibrate_layer_costs(costs, options.balance, stage_action_costs(step, stages));
  const auto plan = options.custom_actions.empty()
                        ? make_schedule(options.schedule, workers, per_worker, options.micro_batches)
                        : options.custom_actions;
  const double send = fit_send_seconds(plan, stage_costs(costs, options.balance), step_span_seconds(step));
  return balance_for_pipeline(options, costs, per_worker, send);
}

/// What Pipeline::train_step returns.
struct StepResult {
  at::Tensor loss;                    ///< the whole batch's loss, as one process computes it
  std::vector<WorkerReport> workers;  ///< one per worker, in stage order of their first stage
};

/// A model cut into stages hosted on other workers, trained one step at a time by a schedule (see
/// corpc/pipeline/pipeline.hpp). Made by create(); copies share the same stages, which the workers drop when the last
/// copy is destroyed (the destructor waits for their answers). The caller holds no parameters: they live, and are
/// updated, on the stages' workers.
class Pipeline {
 public:
  /// Builds Model(args...) on every worker named in `options` (seed it: every worker must get the same weights) and
  /// keeps there the stages placed on it. Loss(output, target) runs on the last stage's worker; MakeOptimizer(params)
  /// makes each stage's optimizer on its worker. Model, Loss and MakeOptimizer are function pointer constants
  /// (`&make_model`), as for rpc_async. Blocks until every worker has built its stages. Throws UsageError for options
  /// that do not fit (no workers, a stage count that is not a multiple of the workers', a schedule that does not fit
  /// the layout, an empty stage, a worker named twice), UnknownWorkerError, and the errors of rpc_async.
  template <auto Model, auto Loss, auto MakeOptimizer, class... A>
  static Pipeline create(const PipelineOptions& options, A&&... args) {
    Pipeline p(options);
    std::vector<Future<void>> made;
    for (int rank : p.state_->worker_ranks)
      made.push_back(rpc_async<&detail::create_stages<Model, Loss, MakeOptimizer, std::decay_t<A>...>>(
          rank, p.state_->placement, args...));
    when_all(std::move(made)).wait();
    return p;
  }

  /// One training iteration: forward and backward of every micro-batch by the schedule, then each stage's optimizer
  /// step. Fails with PipelineError if a stage fails (the other workers abort their part of the step).
  /// `inputs` and `targets` are the whole batch (dimension 0); UsageError if they differ in batch size. A lazy Task:
  /// await it (or sync_wait it); run one step at a time per pipeline.
  Task<StepResult> train_step(at::Tensor inputs, at::Tensor targets);

  /// Training or eval mode on every stage (BatchNorm, Dropout). Blocks until every worker has switched.
  void train(bool on) const;
  /// Copies of every parameter, in the unsplit model's order. Blocks (one RPC per worker).
  std::vector<at::Tensor> parameters() const;

  Schedule schedule() const noexcept { return options_.schedule; }  ///< PipelineOptions::schedule
  /// PipelineOptions::micro_batches, or the custom schedule's M
  int micro_batches() const noexcept { return options_.micro_batches; }
  int num_stages() const noexcept { return static_cast<int>(options_.balance.size()); }       ///< stages in all
  int num_workers() const noexcept { return static_cast<int>(state_->worker_ranks.size()); }  ///< workers hosting them
  int stages_per_worker() const noexcept { return num_stages() / num_workers(); }  ///< v: stages on each worker
  /// This pipeline's action lists for M micro-batches (plan[i] for the i-th worker of `options.workers`). UsageError
  /// for a custom schedule and another M than its own.
  std::vector<std::vector<Action>> plan(int micro_batches) const;

 private:
  struct State {
    detail::StagePlacement placement;
    std::vector<int> worker_ranks;  // one per worker, in the order of options.workers
    std::int64_t steps = 0;
    ~State();
  };
  explicit Pipeline(const PipelineOptions& options);

  PipelineOptions options_;
  std::shared_ptr<State> state_;
};

}  // namespace corpc::pipeline
