// The caller side of corpc::pipeline: placing stages, driving a step, aborting it when a stage fails.
#include "corpc/pipeline/pipeline.hpp"

#include <algorithm>

#include "corpc/rpc/worker_info.hpp"

#include "core/exception_text.hpp"

namespace corpc::pipeline {

using corpc::detail::exception_text;

Pipeline::Pipeline(const PipelineOptions& options) : options_(options), state_(std::make_shared<State>()) {
  const int stages = static_cast<int>(options.balance.size()), workers = static_cast<int>(options.workers.size());
  if (workers < 1) throw UsageError("a pipeline needs at least one worker");
  for (int b : options.balance)
    if (b < 1) throw UsageError("every pipeline stage needs at least one layer");
  std::vector<int> stage_worker;
  if (!options.custom_actions.empty()) {
    if (static_cast<int>(options.custom_actions.size()) != workers)
      throw UsageError("a custom schedule has " + std::to_string(options.custom_actions.size()) + " action lists for " +
                       std::to_string(workers) + " workers");
    stage_worker = check_schedule(options.custom_actions, stages, options.max_held_per_worker);
    options_.micro_batches = schedule_micro_batches(options.custom_actions);
  } else {
    // Rejects a number of stages that is not a whole number per worker (or not two per worker, for a V) ...
    stage_worker = stage_workers(placement_of(options.schedule), workers, stages);
    if (options.micro_batches < 1) throw UsageError("a pipeline needs at least one micro-batch");
    make_schedule(options.schedule, workers, stages / workers, 1);  // ... and a schedule that does not fit the layout
  }
  auto& p = state_->placement;
  p.pipeline_id = detail::next_pipeline_id();
  for (auto& w : options.workers) {
    auto [name, device] = corpc::detail::split_remote_device(w);
    const int rank = get_worker_info(name).rank;
    if (std::find(state_->worker_ranks.begin(), state_->worker_ranks.end(), rank) != state_->worker_ranks.end())
      throw UsageError("worker '" + name + "' named twice in a pipeline");
    state_->worker_ranks.push_back(rank);
  }
  for (int s = 0; s < stages; ++s) {
    p.stage_ranks.push_back(state_->worker_ranks[stage_worker[s]]);
    p.balance.push_back(options.balance[s]);
    p.stage_devices.push_back(corpc::detail::split_remote_device(options.workers[stage_worker[s]]).second);
  }
}

std::vector<std::vector<Action>> Pipeline::plan(int micro_batches) const {
  if (options_.custom_actions.empty())
    return make_schedule(options_.schedule, num_workers(), stages_per_worker(), micro_batches);
  if (micro_batches != options_.micro_batches)
    throw UsageError("this pipeline's custom schedule runs " + std::to_string(options_.micro_batches) +
                     " micro-batches; the batch gives " + std::to_string(micro_batches));
  return options_.custom_actions;
}

Pipeline::State::~State() {
  std::vector<Future<void>> drops;
  for (int rank : worker_ranks) {
    try {
      drops.push_back(rpc_async<&detail::drop_stages>(rank, placement.pipeline_id));
    } catch (const std::exception&) {  // the runtime is gone: so are the stages
    }
  }
  for (auto& f : drops) {
    try {
      f.wait();
    } catch (const std::exception&) {  // a dead worker holds nothing any more
    }
  }
}

void Pipeline::train(bool on) const {
  std::vector<Future<void>> all;
  for (int rank : state_->worker_ranks)
    all.push_back(rpc_async<&detail::set_training>(rank, state_->placement.pipeline_id, on));
  when_all(std::move(all)).wait();
}

std::vector<at::Tensor> Pipeline::parameters() const {
  std::map<std::int32_t, std::vector<at::Tensor>> by_stage;
  for (int rank : state_->worker_ranks)
    for (auto& [s, ps] : rpc_sync<&detail::stage_parameters>(rank, state_->placement.pipeline_id)) by_stage[s] = ps;
  std::vector<at::Tensor> all;
  for (auto& [s, ps] : by_stage) all.insert(all.end(), ps.begin(), ps.end());
  return all;
}

namespace {

// Checked on the whole batch, before anything is sent: chunk() of two different sizes can still give equal counts
// (4 inputs against 8 targets would train on broadcast targets).
void check_batch_sizes(const at::Tensor& inputs, const at::Tensor& targets) {
  if (inputs.dim() != 0 && targets.dim() != 0 && inputs.size(0) == targets.size(0)) return;
  auto batch = [](const at::Tensor& t) { return t.dim() == 0 ? std::string("a scalar") : std::to_string(t.size(0)); };
  throw UsageError("train_step: inputs and targets differ in batch size (dimension 0): " + batch(inputs) + " inputs, " +
                   batch(targets) + " targets");
}

// The index of the step's part that failed first (-1: none yet).
struct FirstFailure {
  std::atomic<int> index{-1};
};

// The first failure aborts the step everywhere, so that no stage waits for a message that will never come.
std::shared_ptr<FirstFailure> abort_all_on_first_failure(const std::vector<Future<WorkerReport>>& parts,
                                                         const std::vector<int>& ranks, std::uint64_t id,
                                                         std::int64_t step) {
  auto first = std::make_shared<FirstFailure>();
  for (std::size_t w = 0; w < parts.size(); ++w) {
    corpc::detail::on_ready_inline(parts[w], [first, w, ranks, id, step, f = parts[w]] {
      int none = -1;
      if (!f.error() || !first->index.compare_exchange_strong(none, static_cast<int>(w))) return;
      const std::string reason = "pipeline step aborted: worker rank " + std::to_string(ranks[w]) + " failed";
      for (std::size_t o = 0; o < ranks.size(); ++o)
        if (o != w) (void)rpc_async<&detail::abort_step>(ranks[o], id, step, reason);
    });
  }
  return first;
}

// A worker that is gone is the cause, whichever part failed first: the others' parts fail because of it, and on a busy
// machine the news of that can reach us before our own connection to the lost worker closes.
std::size_t cause_of_failure(const std::vector<int>& ranks, const std::vector<Future<WorkerReport>>& done,
                             std::size_t first) {
  if (!Runtime::get().is_alive(ranks[first])) return first;
  for (std::size_t o = 0; o < ranks.size(); ++o)
    if (done[o].error() && !Runtime::get().is_alive(ranks[o])) return o;
  return first;
}

// The stages `rank` holds, as "0,2".
std::string stages_on(const detail::StagePlacement& placement, int rank) {
  std::string stages;
  for (std::size_t s = 0; s < placement.stage_ranks.size(); ++s)
    if (placement.stage_ranks[s] == rank) stages += (stages.empty() ? "" : ",") + std::to_string(s);
  return stages;
}

std::string worker_name(int rank) {
  try {
    return get_worker_info(rank).name;
  } catch (const std::exception&) {
    return "rank " + std::to_string(rank);
  }
}

StepResult sum_of(std::vector<Future<WorkerReport>>& done) {
  StepResult result;
  double loss = 0;
  for (auto& f : done) {
    result.workers.push_back(f.value());
    for (double l : result.workers.back().losses) loss += l;
  }
  result.loss = at::scalar_tensor(loss, at::kFloat);
  return result;
}

}  // namespace

Task<StepResult> Pipeline::train_step(at::Tensor inputs, at::Tensor targets) {
  auto state = state_;  // the pipeline may be moved while the step runs
  const std::int64_t step = ++state->steps;
  const std::uint64_t id = state->placement.pipeline_id;
  check_batch_sizes(inputs, targets);
  auto xs = inputs.chunk(options_.micro_batches);
  auto ys = targets.chunk(options_.micro_batches);
  const int micro = static_cast<int>(xs.size());  // chunk() gives fewer pieces for a batch smaller than M
  auto lists = plan(micro);                       // a custom schedule's M differs: UsageError before anything is sent
  const int last_rank = state->placement.stage_ranks.back();

  std::vector<Future<WorkerReport>> parts;
  for (std::size_t w = 0; w < state->worker_ranks.size(); ++w) {
    const int rank = state->worker_ranks[w];
    parts.push_back(rpc_async<&detail::run_step>(rank, id, step, lists[w], w == 0 ? xs : std::vector<at::Tensor>{},
                                                 rank == last_rank ? ys : std::vector<at::Tensor>{},
                                                 options_.loss_reduction == LossReduction::mean ? inputs.size(0) : 0));
  }
  const auto ranks = state->worker_ranks;
  const auto first_failure = abort_all_on_first_failure(parts, ranks, id, step);
  auto all = collect_all(std::move(parts));
  auto done = co_await std::move(all);
  if (const int first = first_failure->index.load(); first >= 0) {
    const std::size_t w = cause_of_failure(ranks, done, static_cast<std::size_t>(first));
    const std::string stages = stages_on(state->placement, ranks[w]);
    const std::string name = worker_name(ranks[w]);
    throw PipelineError("pipeline step " + std::to_string(step) + " failed at stage " + stages + " on worker '" + name +
                        "': " + exception_text(done[w].error()));
  }
  co_return sum_of(done);
}

}  // namespace corpc::pipeline
