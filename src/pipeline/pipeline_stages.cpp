// The worker side of corpc::pipeline: the stages a worker hosts, the mailbox of activations and gradients sent to
// them, and the interpreter of a step's action list.
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "corpc/core/detail/continuation.hpp"
#include "corpc/pipeline/pipeline.hpp"

#include "core/trace_recorder.hpp"
#include "memory/host_allocator.hpp"
#include "pipeline/split_backward.hpp"

namespace corpc::pipeline::detail {
using corpc::detail::host_live_bytes;
using corpc::detail::host_peak_bytes;
using corpc::detail::install_host_allocator;
using corpc::detail::reset_host_peak_bytes;

namespace {

// ---- what a worker hosts --------------------------------------------------------------------------------------------
struct HostedStage {
  torch::nn::Sequential layers;
  c10::Device device{c10::kCPU};
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<at::Tensor> trainable;  // the parameters that require grad: zero bubble's W computes their gradients
};

// One micro-batch on one stage, from its forward to the end of its backward.
struct Held {
  at::Tensor input;   // a leaf that requires grad, except on the first stage
  at::Tensor output;  // the stage's output; on the last stage, the scaled loss
  // Zero bubble, from I to W: the intermediates and their gradients, or (all_in_weights) the output's gradient.
  std::unique_ptr<WeightPass> weights;
  ag::variable_list output_grad;
  bool input_done = false;  // its I has run: its W may run whenever the worker would otherwise wait
};

struct Host : std::enable_shared_from_this<Host> {
  StagePlacement placement;
  int rank = -1;
  LossFn loss;
  std::map<int, HostedStage> stages;

  // Mailbox: what other stages sent, keyed by (step, stage, micro-batch, gradient?). Filled by deliver (I/O thread),
  // taken by the step's interpreter; whichever comes second removes the entry.
  struct Slot {
    Promise<at::Tensor> promise;
    Future<at::Tensor> future = promise.get_future();
    bool taken = false, filled = false;
  };
  using Key = std::tuple<std::int64_t, int, int, bool>;
  std::mutex mutex;
  std::map<Key, Slot> slots;
  std::int64_t aborted_step = -1;
  std::string abort_reason;

  Future<at::Tensor> receive(const Key& key) {
    std::lock_guard lock(mutex);
    if (std::get<0>(key) == aborted_step) {
      Promise<at::Tensor> failed;
      failed.set_exception(PipelineError(abort_reason));
      return failed.get_future();
    }
    auto it = slots.try_emplace(key).first;
    auto f = it->second.future;
    if (it->second.filled) slots.erase(it);
    else it->second.taken = true;
    return f;
  }
  bool arrived(const Key& key) {
    std::lock_guard lock(mutex);
    auto it = slots.find(key);
    return it != slots.end() && it->second.filled;
  }
  void fill(const Key& key, at::Tensor value) {
    std::lock_guard lock(mutex);
    if (std::get<0>(key) == aborted_step) return;
    auto it = slots.try_emplace(key).first;
    it->second.promise.set_value(std::move(value));
    if (it->second.taken) slots.erase(it);
    else it->second.filled = true;
  }
  void abort(std::int64_t step, std::string reason) {
    std::lock_guard lock(mutex);
    aborted_step = step;
    abort_reason = std::move(reason);
    for (auto it = slots.begin(); it != slots.end();) {
      if (std::get<0>(it->first) != step) {
        ++it;
        continue;
      }
      it->second.promise.set_exception(PipelineError(abort_reason));
      it = slots.erase(it);
    }
  }
  void forget_before(std::int64_t step) {  // leftovers of an aborted step
    std::lock_guard lock(mutex);
    for (auto it = slots.begin(); it != slots.end();)
      it = std::get<0>(it->first) < step ? slots.erase(it) : std::next(it);
  }
};

std::mutex g_hosts_mutex;
std::map<std::uint64_t, std::shared_ptr<Host>> g_hosts;

std::shared_ptr<Host> find_host(std::uint64_t id) {
  std::lock_guard lock(g_hosts_mutex);
  auto it = g_hosts.find(id);
  return it == g_hosts.end() ? nullptr : it->second;
}
std::shared_ptr<Host> host_or_throw(std::uint64_t id) {
  auto h = find_host(id);
  if (!h) throw UsageError("this worker hosts no stage of pipeline " + std::to_string(id));
  return h;
}

using trace::now_ns;  // the job trace's clock, so that a stage's timeline and its trace slices agree

// Sends `value` to `stage`'s worker (this one included: then straight into the mailbox).
Future<void> send(Host& host, std::int64_t step, int stage, int micro, bool gradient, at::Tensor value) {
  const int to = host.placement.stage_ranks.at(stage);
  if (to == host.rank) {
    host.fill({step, stage, micro, gradient}, std::move(value));
    Promise<void> done;
    done.set_value();
    return done.get_future();
  }
  auto sent = rpc_async<&deliver>(to, host.placement.pipeline_id, step, stage, micro, gradient, std::move(value));
  // A send that fails ends this worker's step now: the stage that waits for what it carried never gets it, and this
  // worker may itself be waiting for that stage's answer.
  corpc::detail::on_ready_inline(sent, [host = host.shared_from_this(), step, to, sent] {
    if (!sent.has_error()) return;
    try {
      sent.value();
    } catch (const std::exception& e) {
      host->abort(step, "sending to rank " + std::to_string(to) + " failed: " + e.what());
    }
  });
  return sent;
}

at::Tensor grad_or_zeros(const at::Tensor& leaf) { return leaf.grad().defined() ? leaf.grad() : at::zeros_like(leaf); }

}  // namespace

void host_stages(const StagePlacement& placement, torch::nn::Sequential model, LossFn loss,
                 OptimizerFactory optimizer) {
  // Peak activation memory: the host allocator counts what it hands out (libtorch's CPU allocator keeps no statistics).
  install_host_allocator();
  auto host = std::make_shared<Host>();
  host->placement = placement;
  host->rank = get_worker_info().rank;
  host->loss = std::move(loss);
  std::size_t begin = 0;
  std::size_t total = 0;
  for (auto b : placement.balance) total += static_cast<std::size_t>(b);
  if (total != model->size())
    throw UsageError("the balance covers " + std::to_string(total) + " layers; the model has " +
                     std::to_string(model->size()));
  for (std::size_t s = 0; s < placement.balance.size(); ++s) {
    const std::size_t end = begin + static_cast<std::size_t>(placement.balance[s]);
    if (placement.stage_ranks[s] == host->rank) {
      HostedStage st;
      st.device = c10::Device(placement.stage_devices[s]);
      st.layers = slice_layers(model, begin, end);
      st.layers->to(st.device);
      for (auto& p : st.layers->parameters())
        if (p.requires_grad()) st.trainable.push_back(p);
      if (optimizer) st.optimizer = optimizer(st.layers->parameters());
      host->stages.emplace(static_cast<int>(s), std::move(st));
    }
    begin = end;
  }
  std::lock_guard lock(g_hosts_mutex);
  g_hosts[placement.pipeline_id] = std::move(host);
}

void deliver(std::uint64_t id, std::int64_t step, std::int32_t stage, std::int32_t micro, bool gradient,
             at::Tensor value) {
  if (auto host = find_host(id)) host->fill({step, stage, micro, gradient}, std::move(value));
}

void abort_step(std::uint64_t id, std::int64_t step, std::string reason) {
  if (auto host = find_host(id)) host->abort(step, std::move(reason));
}

void drop_stages(std::uint64_t id) {
  std::lock_guard lock(g_hosts_mutex);
  g_hosts.erase(id);
}

void set_training(std::uint64_t id, bool on) {
  for (auto& [s, st] : host_or_throw(id)->stages) st.layers->train(on);
}

std::vector<std::pair<std::int32_t, std::vector<at::Tensor>>> stage_parameters(std::uint64_t id) {
  std::vector<std::pair<std::int32_t, std::vector<at::Tensor>>> out;
  for (auto& [s, st] : host_or_throw(id)->stages) {
    std::vector<at::Tensor> ps;
    for (auto& p : st.layers->parameters()) ps.push_back(p.detach().to(c10::kCPU).clone());
    out.emplace_back(s, std::move(ps));
  }
  return out;
}

namespace {

// One step's run over the stages a host holds: what every action of the step shares (the micro-batches held from
// their F to their last backward, the sends in flight, the report), and what each kind of action does once its input
// is here. run_actions below drives it, awaiting the inputs that come from other workers.
class StepRun {
 public:
  StepRun(std::shared_ptr<Host> host, std::int64_t step, std::vector<Action>& actions, std::vector<at::Tensor>& inputs,
          std::vector<at::Tensor>& targets, std::int64_t mean_over, const StageHooks* hooks)
      : host_(std::move(host)),
        step_(step),
        actions_(actions),
        inputs_(inputs),
        targets_(targets),
        mean_over_(mean_over),
        hooks_(hooks),
        last_(static_cast<int>(host_->placement.stage_ranks.size()) - 1) {}

  // Before the first action: this step's gradients only, and the memory baseline the peak is measured from.
  void begin() {
    host_->forget_before(step_);
    for (const auto& a : actions_)
      if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) ++backwards_left_[a.stage];
    report_.rank = host_->rank;
    for (auto& [s, st] : host_->stages) {
      report_.stages.push_back(s);
      // Zeroed rather than dropped: they stay allocated from the first step on, so the activation peak does not
      // count them.
      for (auto& p : st.layers->parameters())
        if (p.grad().defined()) p.mutable_grad().zero_();
    }
    report_.losses.assign(targets_.size(), 0.0);
    reset_host_peak_bytes();
    baseline_ = host_live_bytes();
  }

  // Whether action `a` takes its input from another worker (an activation, or an output's gradient).
  bool needs_message(const Action& a) const {
    if (a.kind == ActionKind::Forward) return a.stage != 0;
    if (a.kind == ActionKind::BackwardWeight) return false;
    return a.stage != last_;
  }
  Host::Key mail_key(const Action& a) const { return {step_, a.stage, a.micro, a.kind != ActionKind::Forward}; }

  // Reorders the actions from `i` on by what has arrived, so that the worker waits less.
  void reorder_for_arrivals(std::size_t i) {
    // An overlapped pair starts with whichever of its two inputs is here: the backward when the forward's activation
    // has not come yet but the backward's gradient has.
    if (actions_[i].overlap && i + 1 < actions_.size()) {
      if (!input_here(actions_[i]) && input_here(actions_[i + 1])) {
        std::swap(actions_[i], actions_[i + 1]);
        actions_[i + 1].overlap = false;  // the pair is decided; the forward does not pair with what follows
      }
    }
    // Rather than wait for an input, run a W the list has later whose I is done: a W sends nothing, so running it
    // earlier changes no other worker's wait, and it frees its micro-batch sooner. This keeps zero bubble's Ws in
    // the waits when real stage times differ from the unit times the order was made with.
    if (actions_[i].kind == ActionKind::BackwardWeight || input_here(actions_[i])) return;
    for (std::size_t j = i + 1; j < actions_.size(); ++j) {
      if (actions_[j].kind != ActionKind::BackwardWeight) continue;
      if (auto h = held_.find({actions_[j].stage, actions_[j].micro}); h != held_.end() && h->second.input_done) {
        std::rotate(actions_.begin() + static_cast<std::ptrdiff_t>(i),
                    actions_.begin() + static_cast<std::ptrdiff_t>(j),
                    actions_.begin() + static_cast<std::ptrdiff_t>(j) + 1);
        return;
      }
    }
  }

  HostedStage& stage_of(const Action& a) {
    auto found = host_->stages.find(a.stage);
    if (found == host_->stages.end())
      throw UsageError("action for stage " + std::to_string(a.stage) + " not hosted here");
    return found->second;
  }

  // Runs `a` on `st` with `received` (what needs_message said it waits for; undefined otherwise) and records it.
  void run(const Action& a, HostedStage& st, at::Tensor received) {
    ActionRecord record;
    record.action = a;
    record.rank = host_->rank;
    record.start_ns = now_ns();
    if (a.kind == ActionKind::Forward) forward(a, st, std::move(received));
    else if (a.kind == ActionKind::BackwardWeight) weights(a);
    else backward(a, st, std::move(received));
    record.end_ns = now_ns();
    report_.records.push_back(record);
    after(a, record);
  }

  std::vector<Future<void>> take_sends() { return std::move(sends_); }

  WorkerReport finish() {
    report_.peak_activation_bytes = host_peak_bytes() - baseline_;
    return std::move(report_);
  }

 private:
  // Whether what `a` consumes is here (or needs no message: the first stage's forward, the last's backward, a W).
  bool input_here(const Action& a) const { return !needs_message(a) || host_->arrived(mail_key(a)); }

  void forward(const Action& a, HostedStage& st, at::Tensor x) {
    if (a.stage == 0) x = inputs_.at(a.micro);
    Held h;
    x = x.to(st.device).detach();
    if (a.stage != 0 && x.is_floating_point()) x.requires_grad_(true);
    h.input = x;
    at::Tensor y = x;
    for (auto& layer : *st.layers) y = layer.forward(y);
    if (a.stage == last_) {
      const at::Tensor& target = targets_.at(a.micro);
      // A mean over the batch is the sum of the micro-batches' means weighted by their shares; a sum needs none.
      const double share = mean_over_ > 0 ? static_cast<double>(target.size(0)) / static_cast<double>(mean_over_) : 1.0;
      h.output = host_->loss(y, target.to(st.device)) * share;
      report_.losses[a.micro] = h.output.item<double>();
    } else {
      h.output = y;
      sends_.push_back(send(*host_, step_, a.stage + 1, a.micro, false, y.detach()));
    }
    held_.emplace(std::pair<int, int>{a.stage, a.micro}, std::move(h));
    report_.peak_micro_batches_held =
        std::max<std::int32_t>(report_.peak_micro_batches_held, static_cast<std::int32_t>(held_.size()));
  }

  // B (the whole backward), or I (the input's gradient; what W needs is kept: see plan_split).
  void backward(const Action& a, HostedStage& st, const at::Tensor& g) {
    const bool first_stage = a.stage == 0;
    auto it = held_.find({a.stage, a.micro});
    if (it == held_.end()) throw UsageError("backward before forward for stage " + std::to_string(a.stage));
    Held& h = it->second;
    torch::autograd::variable_list grad_out;
    if (g.defined()) grad_out.push_back(g.to(st.device));
    at::Tensor input_grad;
    if (a.kind == ActionKind::Backward) {
      if (h.output.requires_grad()) torch::autograd::backward({h.output}, grad_out);
      if (!first_stage) input_grad = grad_or_zeros(h.input);
      held_.erase(it);
    } else {
      h.input_done = true;  // from the next action on, its W may run early
      input_grad = input_gradient(h, st, std::move(grad_out), first_stage);
    }
    if (!first_stage) sends_.push_back(send(*host_, step_, a.stage - 1, a.micro, true, input_grad.detach()));
  }

  // I's share of a split backward: the input's gradient, with what W will need left in `h`.
  static at::Tensor input_gradient(Held& h, HostedStage& st, torch::autograd::variable_list grad_out,
                                   bool first_stage) {
    at::Tensor input_grad;
    if (!h.output.requires_grad()) {
      if (!first_stage) input_grad = at::zeros_like(h.input);
      h.output = at::Tensor();  // nothing for W either
      return input_grad;
    }
    auto pass = std::make_unique<WeightPass>();
    switch (plan_split(h.output, h.input, st.trainable, *pass)) {
      case Split::input_and_weights: {
        auto grads = torch::autograd::grad({h.output}, {h.input}, grad_out, /*retain_graph=*/true,
                                           /*create_graph=*/false, /*allow_unused=*/true);
        input_grad = grads[0].defined() ? grads[0] : at::zeros_like(h.input);
        h.weights = std::move(pass);
        h.output = h.input = at::Tensor();  // W starts at the intermediates: what lies above them can go
        break;
      }
      case Split::all_in_weights:
        if (!first_stage) input_grad = at::zeros_like(h.input);  // (an input the output does not depend on)
        h.output_grad = std::move(grad_out);
        break;
      case Split::all_in_input:
        torch::autograd::backward({h.output}, grad_out);
        input_grad = grad_or_zeros(h.input);
        h.output = at::Tensor();
        break;
    }
    return input_grad;
  }

  // W: what I left (see plan_split).
  void weights(const Action& a) {
    auto it = held_.find({a.stage, a.micro});
    if (it == held_.end()) throw UsageError("W before I for stage " + std::to_string(a.stage));
    Held& h = it->second;
    if (h.weights) run_weight_pass(*h.weights);
    else if (h.output.defined()) torch::autograd::backward({h.output}, h.output_grad);
    held_.erase(it);
  }

  // `hooks` hears when a stage's gradients are complete: after its last backward, a B or a W, counted rather than
  // found by position because the actions are reordered at run time.
  void after(const Action& a, const ActionRecord& record) {
    if (hooks_) {
      if ((a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardWeight) && --backwards_left_[a.stage] == 0 &&
          hooks_->stage_backward_done)
        hooks_->stage_backward_done(a.stage);
      if (hooks_->after_action) hooks_->after_action(a);
    }
    if (trace::enabled()) [[unlikely]] {
      trace::detail::record({.kind = trace::detail::Kind::pipeline_action,
                             .t0 = record.start_ns,
                             .t1 = record.end_ns,
                             .name = action_letter(a.kind) + std::to_string(a.micro) + "/s" + std::to_string(a.stage)});
    }
  }

  std::shared_ptr<Host> host_;
  const std::int64_t step_;
  std::vector<Action>& actions_;
  std::vector<at::Tensor>& inputs_;
  std::vector<at::Tensor>& targets_;
  const std::int64_t mean_over_;
  const StageHooks* hooks_;
  const int last_;                            // the last stage's index
  std::map<int, int> backwards_left_;         // per stage: the Bs and Ws still to run
  std::map<std::pair<int, int>, Held> held_;  // by (stage, micro-batch): from its F to its last backward
  std::vector<Future<void>> sends_;
  WorkerReport report_;
  std::int64_t baseline_ = 0;
};

// Runs one step's actions on the stages `host` holds: every forward and backward, no optimizer step. `hooks` (may be
// null) hears when a stage's gradients are complete.
Task<WorkerReport> run_actions(std::shared_ptr<Host> host, std::int64_t step, std::vector<Action> actions,
                               std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets, std::int64_t mean_over,
                               const StageHooks* hooks) {
  StepRun run(host, step, actions, inputs, targets, mean_over, hooks);
  run.begin();
  for (std::size_t i = 0; i < actions.size(); ++i) {
    run.reorder_for_arrivals(i);
    const Action a = actions[i];
    HostedStage& st = run.stage_of(a);
    at::Tensor received;
    if (run.needs_message(a)) {
      Future<at::Tensor> incoming = host->receive(run.mail_key(a));
      received = co_await incoming;
    }
    run.run(a, st, std::move(received));
  }
  std::vector<Future<void>> sends = run.take_sends();
  co_await when_all(std::move(sends));
  co_return run.finish();
}

}  // namespace

Task<WorkerReport> run_step(std::uint64_t id, std::int64_t step, std::vector<Action> actions,
                            std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets, std::int64_t mean_over) {
  auto host = host_or_throw(id);
  WorkerReport report =
      co_await run_actions(host, step, std::move(actions), std::move(inputs), std::move(targets), mean_over, nullptr);
  for (auto& [s, st] : host->stages)
    if (st.optimizer) st.optimizer->step();
  co_return report;
}

Task<WorkerReport> run_local_step(std::uint64_t id, std::int64_t attempt, std::vector<Action> actions,
                                  std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
                                  std::int64_t mean_over, const StageHooks& hooks) {
  return run_actions(host_or_throw(id), attempt, std::move(actions), std::move(inputs), std::move(targets), mean_over,
                     &hooks);
}

std::vector<LocalStage> local_stages(std::uint64_t id) {
  std::vector<LocalStage> out;
  for (auto& [s, st] : host_or_throw(id)->stages) out.push_back({s, st.layers, st.optimizer.get()});
  return out;
}

std::uint64_t next_pipeline_id() {
  static std::atomic<std::uint32_t> counter{0};
  return (static_cast<std::uint64_t>(get_worker_info().rank) << 32) | ++counter;
}

}  // namespace corpc::pipeline::detail
