// Pipeline replicas (see corpc/ddp/pipeline_replicas.hpp): one worker. Under fault tolerance it is what the quorum
// member's attempt loop (ft_member.hpp) asks of a trainer: at a new epoch, a Gloo group per stage among the replicas
// of the quorum; an attempt runs this worker's actions (pipeline::detail::run_local_step) with each stage's averaging
// started by the stage's last backward; a committed one steps the optimizers; the coordinator's abort stops an
// attempt waiting for a lost mate. Without it, the same step on fixed groups.
#include "corpc/ddp/pipeline_replicas.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <future>
#include <mutex>
#include <string>

#include "corpc/core/sync_wait.hpp"
#include "corpc/core/trace.hpp"
#include "corpc/ddp/replica_checkpoint.hpp"
#include "corpc/ddp/rpc_store.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

#include "core/log.hpp"
#include "ddp/ft_member.hpp"
#include "ddp/ft_messages.hpp"
#include "ddp/optimizer_bytes.hpp"
#include "ddp/process_group.hpp"
#include "ddp/replica_checkpoint_files.hpp"

namespace corpc::ddp {

namespace pp_detail {
// A restarted worker calls each of its replica mates once, so that they take its rank back (RpcOptions::rejoin): until
// the new incarnation has connected to a peer, that peer's calls to the rank fail.
void hello() {}
}  // namespace pp_detail

std::vector<std::vector<int>> ReplicaLayout::replica_groups() const {
  std::vector<std::vector<int>> out(static_cast<size_t>(replicas));
  for (int r = 0; r < replicas; ++r)
    for (int p = 0; p < workers_per_replica; ++p) out[static_cast<size_t>(r)].push_back(rank(r, p));
  return out;
}

namespace {

int stages_per_worker(const PipelineReplicaOptions& o) {
  return o.stages_per_worker > 0 ? o.stages_per_worker : pipeline::min_stages_per_worker(o.schedule);
}

}  // namespace

ReplicaLayout layout_of(const PipelineReplicaOptions& o) {
  if (o.replicas < 1) throw UsageError("PipelineReplicaOptions::replicas must be at least 1");
  const int stages = static_cast<int>(o.balance.size()), v = stages_per_worker(o);
  if (stages < 1 || stages % v != 0)
    throw UsageError(std::string(pipeline::to_string(o.schedule)) + " with " + std::to_string(v) +
                     " stages per worker does not fit " + std::to_string(stages) + " stages");
  ReplicaLayout layout;
  layout.replicas = o.replicas;
  layout.workers_per_replica = stages / v;
  layout.first_rank = o.first_rank;
  return layout;
}

struct PipelineReplicas::State final : ft_detail::Trainer {
  PipelineReplicaOptions options;
  ReplicaLayout layout;
  int rank = -1, replica = -1, position = -1;
  std::uint64_t host_id = 0;
  std::vector<pipeline::Action> actions;  // this worker's, every step
  std::vector<pipeline::detail::LocalStage> stages;
  bool has_first = false, has_last = false;
  std::shared_ptr<ft_detail::Member> member;  // null without fault tolerance

  // A group and its averaging per stage held (none while this stage's replica is the only member).
  struct Averaging {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::unique_ptr<GradientSync> sync;
    bool launched = false;
    std::int64_t started_ns = 0, finished_ns = 0;
  };
  std::vector<Averaging> averaging;  // parallel to `stages`
  std::int64_t epoch = -1;           // of `averaging`
  std::int64_t plain_steps = 0;      // without fault tolerance
  // The step() call in progress, under fault tolerance: its batches, and the report its attempts fill.
  const ReplicaBatchFn* step_batch = nullptr;
  ReplicaStepReport* step_report = nullptr;

  // Checkpoints: the replicas of the last committed step (its lowest writes), whether a step ran, the write in
  // flight.
  std::vector<int> last_replicas;
  bool stepped = false;
  std::future<void> writing;

  // Stage `stage`'s layers in the whole model: [first, first + count).
  ckpt_detail::StageMeta meta_of(int stage, std::int64_t step) const {
    ckpt_detail::StageMeta m;
    m.step = step;
    m.stage = stage;
    m.stages = static_cast<int>(options.balance.size());
    for (int s = 0; s < stage; ++s) m.first_layer += options.balance[static_cast<size_t>(s)];
    m.layers = options.balance[static_cast<size_t>(stage)];
    return m;
  }

  // Stage `i` as it was before a checkpoint's load: its parameters and buffers, and its optimizer's state as bytes.
  void put_back(size_t i, const std::pair<std::vector<at::Tensor>, at::Tensor>& was) {
    torch::NoGradGuard no_grad;
    auto& layers = *stages[i].layers;
    size_t k = 0;
    for (auto& t : layers.parameters()) t.detach().copy_(was.first[k++]);
    for (auto& t : layers.buffers()) t.detach().copy_(was.first[k++]);
    auto archive = detail::optimizer_archive(was.second);
    stages[i].optimizer->load(archive);
  }

  // Without fault tolerance: a lost replica mate or stage peer fails the attempt running (or the next one).
  std::mutex failure_mutex;
  std::int64_t running = -1;
  std::string lost;

  // A restarted worker's replica mates it could not call yet (pp_detail::hello). In a quorum they are sure to be up:
  // two mates restarted together may not have reached each other before.
  std::vector<int> to_greet;
  void greet_mates() {
    while (!to_greet.empty()) {
      rpc_sync<&pp_detail::hello>(to_greet.back(), with_timeout(options.ft.collective_timeout));
      to_greet.pop_back();
    }
  }

  static std::int64_t attempt_of(std::int64_t epoch, std::int64_t step) { return (epoch << 32) | step; }

  std::vector<int> replicas_of(const std::vector<int>& ranks) const {
    std::vector<int> out;
    for (int r : ranks) out.push_back(layout.replica_of(r));
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }

  // A Gloo group per stage held, among the workers that hold it in `replicas`; in ascending stage order, which every
  // member of a stage's group shares (they hold the same stages).
  void join_groups(std::int64_t at_epoch, const std::vector<int>& replicas) {
    averaging.clear();
    averaging.resize(stages.size());
    const auto index = std::find(replicas.begin(), replicas.end(), replica) - replicas.begin();
    if (replicas.size() > 1) {
      const auto& ft = options.ft;
      auto base = c10::make_intrusive<RpcStore>(ft.coordinator_rank, ft.collective_timeout);
      for (size_t i = 0; i < stages.size(); ++i) {
        auto store = c10::make_intrusive<c10d::PrefixStore>(
            "corpc/pp/epoch/" + std::to_string(at_epoch) + "/stage/" + std::to_string(stages[i].stage) + "/", base);
        averaging[i].group = detail::gloo_group(store, static_cast<int>(index), static_cast<int>(replicas.size()),
                                                ft.collective_timeout, detail::rpc_host());
        averaging[i].sync =
            std::make_unique<GradientSync>(*stages[i].layers, averaging[i].group, ft.ddp, GradientSync::Manual{});
      }
    }
    epoch = at_epoch;
  }

  // Off the epoch's groups (a failed attempt, or a new epoch): the next attempt builds fresh ones (and zeroes this
  // attempt's gradients).
  void leave_epoch() override {
    averaging.clear();
    epoch = -1;
  }

  void launch(size_t i) {
    auto& a = averaging[i];
    if (a.launched || !a.sync) return;
    a.launched = true;
    a.started_ns = trace::now_ns();
    a.sync->launch_all();
  }

  // This replica's share of a step's batch, cut into micro-batches where this worker needs them: inputs for the first
  // stage, targets for the last.
  struct Share {
    std::vector<at::Tensor> inputs, targets;
    std::int64_t mean_over = 0;  // the replica's batch size when the loss is a mean
  };
  Share share_of(std::int64_t step, const ReplicaBatchFn& batch) const {
    const int M = options.micro_batches;
    Share share;
    if (!has_first && !has_last) return share;
    auto [x, y] = batch(step, replica);
    if (x.size(0) != y.size(0) || x.size(0) < M)
      throw UsageError(
          "PipelineReplicas: a replica's batch needs as many targets as inputs, and at least one per "
          "micro-batch (" +
          std::to_string(x.size(0)) + " inputs, " + std::to_string(y.size(0)) + " targets, " + std::to_string(M) +
          " micro-batches)");
    if (options.loss_reduction == pipeline::LossReduction::mean) share.mean_over = x.size(0);
    if (has_first) share.inputs = x.chunk(M);
    if (has_last) share.targets = y.chunk(M);
    return share;
  }

  // Each attempt starts from zero gradients with no averaging launched: a retry adds nothing to what a failed attempt
  // left.
  void reset_gradients() {
    for (auto& st : stages)
      for (auto& p : st.layers->parameters())
        if (p.grad().defined()) p.mutable_grad().zero_();
    for (auto& a : averaging) a.launched = false;
  }

  // What the worker's step calls back: options.after_action after each action, and at a stage's last backward that
  // stage's averaging, started at once while the worker goes on with its other stages.
  pipeline::detail::StageHooks hooks_for(std::int64_t step) {
    pipeline::detail::StageHooks hooks;
    if (options.after_action)
      hooks.after_action = [this, step](const pipeline::Action& a) { options.after_action(step, a); };
    hooks.stage_backward_done = [this, step](int stage) {
      if (options.before_averaging) options.before_averaging(step, stage);
      for (size_t i = 0; i < stages.size(); ++i)
        if (stages[i].stage == stage) launch(i);
    };
    return hooks;
  }

  // Marks `attempt` as running, so that a lost peer aborts it (without fault tolerance); fails at once if one was
  // lost already.
  void enter_attempt(std::int64_t attempt, std::int64_t step) {
    std::lock_guard lock(failure_mutex);
    if (!lost.empty()) throw ConnectionError("PipelineReplicas: step " + std::to_string(step) + " failed: " + lost);
    running = attempt;
  }
  void leave_attempt() {
    std::lock_guard lock(failure_mutex);
    running = -1;
  }

  // Every stage's averaging takes place even after a failure (then with whatever gradients there are): the other
  // replicas' workers are in it, and would otherwise wait for their collective's timeout. Keeps the first error.
  void finish_averaging(std::exception_ptr& error) {
    for (size_t i = 0; i < averaging.size(); ++i) {
      try {
        launch(i);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
    for (auto& a : averaging) {
      if (!a.launched) continue;
      try {
        a.sync->finish_launched();
        a.finished_ns = trace::now_ns();
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
  }

  void report_attempt(pipeline::WorkerReport report, ReplicaStepReport& out) const {
    if (has_last) {
      double sum = 0;
      for (double l : report.losses) sum += l;
      out.loss = sum;
    }
    out.worker = std::move(report);
    out.averaging.clear();
    for (size_t i = 0; i < averaging.size(); ++i)
      if (averaging[i].sync)
        out.averaging.push_back({stages[i].stage, averaging[i].started_ns, averaging[i].finished_ns});
  }

  // One attempt: this worker's actions, and every stage's averaging. Throws the first error.
  void run(std::int64_t attempt, std::int64_t step, const ReplicaBatchFn& batch, ReplicaStepReport& out) {
    auto share = share_of(step, batch);
    reset_gradients();
    const auto hooks = hooks_for(step);
    enter_attempt(attempt, step);
    std::exception_ptr error;
    pipeline::WorkerReport report;
    try {
      report = sync_wait(pipeline::detail::run_local_step(host_id, attempt, actions, std::move(share.inputs),
                                                          std::move(share.targets), share.mean_over, hooks));
    } catch (...) {
      error = std::current_exception();
    }
    finish_averaging(error);
    leave_attempt();
    if (error) std::rethrow_exception(error);
    report_attempt(std::move(report), out);
  }

  void step_optimizers() {
    for (auto& st : stages) st.optimizer->step();
  }

  ReplicaStepReport plain_step(const ReplicaBatchFn& batch) {
    ReplicaStepReport report;
    for (int r = 0; r < layout.replicas; ++r) report.replicas.push_back(r);
    if (epoch < 0) join_groups(0, report.replicas);
    run(plain_steps, plain_steps, batch, report);
    step_optimizers();
    report.ft.quorum.step = plain_steps++;
    return report;
  }

  // The trainer of the quorum member's attempt loop (fault tolerance).
  const char* name() const override { return "PipelineReplicas"; }
  void join_epoch(const Quorum& q) override {
    greet_mates();
    join_groups(q.epoch, replicas_of(q.members));
  }
  void run_attempt(const Quorum& q) override {
    step_report->loss.reset();
    run(attempt_of(q.epoch, q.step), q.step, *step_batch, *step_report);
  }
  void commit() override { step_optimizers(); }
  void abort_attempt(std::int64_t at_epoch, std::int64_t step, const std::string& why) override {
    pipeline::detail::abort_step(host_id, attempt_of(at_epoch, step), "PipelineReplicas: " + why);
  }

  ReplicaStepReport fault_tolerant_step(const ReplicaBatchFn& batch) {
    ReplicaStepReport out;
    step_batch = &batch;
    step_report = &out;
    out.ft = member->step();
    out.replicas = replicas_of(out.ft.quorum.members);
    return out;
  }

  // Hosts this worker's stages of `model` as `placement` places them.
  void host(const pipeline::detail::StagePlacement& placement, torch::nn::Sequential model, pipeline::LossFn loss,
            pipeline::OptimizerFactory make_optimizer) {
    host_id = placement.pipeline_id;
    detail::ignore_sigpipe_unless_handled();  // before any group: see its comment
    pipeline::detail::host_stages(placement, std::move(model), std::move(loss), std::move(make_optimizer));
    stages = pipeline::detail::local_stages(host_id);
    const int count = static_cast<int>(placement.stage_ranks.size());
    for (const auto& st : stages) {
      has_first = has_first || st.stage == 0;
      has_last = has_last || st.stage == count - 1;
    }
  }

  // Fault tolerance: the quorum member's attempt loop drives this trainer.
  static void become_member(const std::shared_ptr<State>& self) {
    std::vector<ft_detail::Member::Part> parts;
    for (auto& st : self->stages) parts.push_back({st.layers.ptr().get(), st.optimizer});
    try {  // the coordinator refuses a job whose replica groups are not its own: nothing of it stays hosted then
      self->member =
          std::make_shared<ft_detail::Member>(self, std::move(parts), self->options.ft, self->layout.replica_groups());
      ft_detail::register_member(self->member);
    } catch (...) {
      pipeline::detail::drop_stages(self->host_id);
      throw;
    }
  }

  // Without fault tolerance: a lost replica mate or stage peer fails the step running, and the next one.
  static void watch_peers(const std::shared_ptr<State>& self) {
    std::weak_ptr<State> weak = self;
    Runtime::get().add_peer_failure_listener([weak](int peer, const std::string& why) {
      if (auto state = weak.lock()) state->on_peer_lost(peer, why);
    });
  }
  void on_peer_lost(int peer, const std::string& why) {
    if (peer < layout.first_rank || peer >= layout.first_rank + layout.world()) return;
    if (layout.replica_of(peer) != replica && layout.position_of(peer) != position) return;  // not a peer of ours
    std::int64_t attempt;
    {
      std::lock_guard lock(failure_mutex);
      lost = ft_detail::worker_text(peer) + " was lost: " + why;
      attempt = running;
    }
    // Without fault tolerance an attempt is the step itself.
    if (attempt >= 0)
      pipeline::detail::abort_step(host_id, attempt,
                                   "PipelineReplicas: step " + std::to_string(attempt) + " failed: " + lost);
  }

  // A restarted worker calls its replica mates now, before it asks for a quorum, so that a mate's first send to it
  // finds it taken back; a mate that is itself restarting is called again once both are in a quorum (greet_mates).
  void greet_mates_on_rejoin() {
    for (int p = 0; p < layout.workers_per_replica; ++p) {
      if (p == position) continue;
      try {
        rpc_sync<&pp_detail::hello>(layout.rank(replica, p), with_timeout(options.ft.collective_timeout));
      } catch (const std::exception&) {
        to_greet.push_back(layout.rank(replica, p));
      }
    }
  }
};

namespace {

void check_job_fits(const ReplicaLayout& layout, int rank, int world_size) {
  if (rank < layout.first_rank || rank >= layout.first_rank + layout.world())
    throw UsageError("PipelineReplicas: rank " + std::to_string(rank) + " is not one of the workers (ranks " +
                     std::to_string(layout.first_rank) + ".." + std::to_string(layout.first_rank + layout.world() - 1) +
                     ")");
  if (layout.first_rank + layout.world() > world_size)
    throw UsageError("PipelineReplicas: " + std::to_string(layout.world()) + " workers from rank " +
                     std::to_string(layout.first_rank) + " need " + std::to_string(layout.first_rank + layout.world()) +
                     " ranks; the job has " + std::to_string(world_size));
}

// Where `replica`'s stages are: stage s on the worker at position where[s].
pipeline::detail::StagePlacement replica_placement(const PipelineReplicaOptions& options, const ReplicaLayout& layout,
                                                   int replica, const std::vector<int>& where) {
  pipeline::detail::StagePlacement placement;
  // Deterministic, so that a restarted worker's mailbox is the one its mates send to.
  placement.pipeline_id = (std::uint64_t{1} << 63) | static_cast<std::uint64_t>(replica);
  for (size_t st = 0; st < options.balance.size(); ++st) {
    placement.stage_ranks.push_back(layout.rank(replica, where[st]));
    placement.balance.push_back(options.balance[st]);
    placement.stage_devices.push_back("cpu");
  }
  return placement;
}

}  // namespace

PipelineReplicas::PipelineReplicas(torch::nn::Sequential model, pipeline::LossFn loss,
                                   pipeline::OptimizerFactory make_optimizer, PipelineReplicaOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  auto& rt = Runtime::get();
  if (!make_optimizer) throw UsageError("PipelineReplicas: a stage needs an optimizer");
  if (options.micro_batches < 1) throw UsageError("PipelineReplicas: at least one micro-batch");
  s.layout = layout_of(options);
  s.rank = rt.rank();
  check_job_fits(s.layout, s.rank, rt.world_size());
  s.replica = s.layout.replica_of(s.rank);
  s.position = s.layout.position_of(s.rank);
  const int stages = static_cast<int>(options.balance.size());
  const int W = s.layout.workers_per_replica;
  const auto where = pipeline::stage_workers(pipeline::placement_of(options.schedule), W, stages);
  s.actions = pipeline::make_schedule(options.schedule, W, stages / W, options.micro_batches)[s.position];
  s.host(replica_placement(options, s.layout, s.replica, where), std::move(model), std::move(loss),
         std::move(make_optimizer));
  s.options = std::move(options);
  if (s.options.fault_tolerant) State::become_member(state_);
  else State::watch_peers(state_);
  if (rt.options().rejoin) s.greet_mates_on_rejoin();
}

PipelineReplicas::~PipelineReplicas() {
  try {
    wait_checkpoint();
  } catch (const std::exception& e) {
    corpc::detail::log(corpc::detail::LogLevel::warn, "PipelineReplicas", "~PipelineReplicas",
                       "a checkpoint was not written: {}", e.what());
  }
  state_->averaging.clear();
  pipeline::detail::drop_stages(state_->host_id);
}

ReplicaStepReport PipelineReplicas::step(const ReplicaBatchFn& batch) {
  state_->stepped = true;
  auto report = state_->member ? state_->fault_tolerant_step(batch) : state_->plain_step(batch);
  state_->last_replicas = report.replicas;
  return report;
}

std::string PipelineReplicas::save_checkpoint(const std::string& root) {
  auto& s = *state_;
  wait_checkpoint();
  const std::int64_t step = committed_steps();
  const std::string dir = replica_checkpoint_dir(root, step);
  if (s.last_replicas.empty() || s.last_replicas.front() != s.replica) return dir;
  std::vector<std::pair<torch::serialize::OutputArchive, ckpt_detail::StageMeta>> files;
  for (const auto& st : s.stages) {
    const auto meta = s.meta_of(st.stage, step);
    files.emplace_back(ckpt_detail::snapshot_stage(st.layers, *st.optimizer, meta), meta);
  }
  s.writing = std::async(std::launch::async, [files = std::move(files), dir]() mutable {
    for (auto& [archive, meta] : files) ckpt_detail::write_stage(archive, dir, meta);
  });
  return dir;
}

void PipelineReplicas::wait_checkpoint() {
  if (state_->writing.valid()) state_->writing.get();
}

std::int64_t PipelineReplicas::load_checkpoint(const std::string& step_dir) {
  auto& s = *state_;
  if (s.stepped) throw UsageError("PipelineReplicas::load_checkpoint: before the first step only");
  const int stages = static_cast<int>(s.options.balance.size());
  if (const int theirs = ckpt_detail::stage_count(step_dir); theirs != stages)
    throw UsageError("PipelineReplicas::load_checkpoint: " + step_dir + " holds " + std::to_string(theirs) +
                     " stages; this job cuts the model into " + std::to_string(stages));
  // Every file read and checked before anything is loaded.
  std::vector<ckpt_detail::StageFile> files;
  for (const auto& st : s.stages) {
    auto f = ckpt_detail::read_stage(step_dir, st.stage, stages);
    const auto mine = s.meta_of(st.stage, f.meta.step);
    if (f.meta.first_layer != mine.first_layer || f.meta.layers != mine.layers)
      throw UsageError("PipelineReplicas::load_checkpoint: stage " + std::to_string(st.stage) + " of " + step_dir +
                       " holds layers " + std::to_string(f.meta.first_layer) + ".." +
                       std::to_string(f.meta.first_layer + f.meta.layers - 1) + ", this job's " +
                       std::to_string(mine.first_layer) + ".." + std::to_string(mine.first_layer + mine.layers - 1) +
                       ": a stage's optimizer state fits the same cut only (load_replica_checkpoint loads a whole "
                       "model's parameters from any cut)");
    if (!files.empty() && f.meta.step != files.front().meta.step)
      throw UsageError("PipelineReplicas::load_checkpoint: " + step_dir + " mixes steps");
    ckpt_detail::check_loadable(*st.layers, f.layers, "stage " + std::to_string(st.stage) + " of " + step_dir);
    files.push_back(std::move(f));
  }
  const std::int64_t step = files.empty() ? 0 : files.front().meta.step;
  // Whether a stage's optimizer state fits this job's optimizer (the same kind) shows only as it loads: a stage that
  // does not puts back every stage loaded before it, so that a refused checkpoint leaves the job as it was.
  std::vector<std::pair<std::vector<at::Tensor>, at::Tensor>> before;
  for (const auto& st : s.stages) {
    std::vector<at::Tensor> tensors;
    for (const auto& t : st.layers->parameters()) tensors.push_back(t.detach().clone());
    for (const auto& t : st.layers->buffers()) tensors.push_back(t.detach().clone());
    before.emplace_back(std::move(tensors), detail::optimizer_bytes(*st.optimizer));
  }
  for (size_t i = 0; i < files.size(); ++i) {
    try {
      s.stages[i].layers->load(files[i].layers);
      s.stages[i].optimizer->load(files[i].optimizer);
    } catch (const std::exception& e) {
      for (size_t j = 0; j <= i; ++j) s.put_back(j, before[j]);
      throw UsageError("PipelineReplicas::load_checkpoint: the optimizer state of stage " +
                       std::to_string(s.stages[i].stage) + " of " + step_dir +
                       " does not load into this job's optimizer (a checkpoint loads into the kind of optimizer that "
                       "saved it): " +
                       e.what());
    }
  }
  if (s.member) s.member->restored(step);
  else s.plain_steps = step;
  return step;
}

std::int64_t PipelineReplicas::committed_steps() const {
  return state_->member ? state_->member->committed() : state_->plain_steps;
}
const ReplicaLayout& PipelineReplicas::layout() const { return state_->layout; }
int PipelineReplicas::replica() const { return state_->replica; }
int PipelineReplicas::position() const { return state_->position; }

std::vector<ReplicaStage> PipelineReplicas::stages() const {
  std::vector<ReplicaStage> out;
  for (const auto& st : state_->stages) out.push_back({st.stage, st.layers, st.optimizer});
  return out;
}

}  // namespace corpc::ddp

CORPC_IO_THREAD_FUNCTION(&corpc::ddp::pp_detail::hello);
