// The worker side of corpc::pipeline: the stages a worker hosts, the mailbox of activations and gradients sent to
// them, and the interpreter of a step's action list.
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "corpc/pipeline/pipeline.hpp"
#include "memory/host_allocator.hpp"
#include "core/trace_recorder.hpp"

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

// ---- zero bubble's split backward -----------------------------------------------------------------------------------
// I and W split the backward at the graph's "intermediates" (as torch.distributed.pipelining does): the nodes that
// depend on the stage's input and have an edge into the part of the graph that leads to a parameter (a convolution,
// a batch norm, an addmm: where an activation's gradient meets a weight). I asks the engine for the input's gradient
// alone, so every node on the way computes only the outputs that lead to the input (generated backward nodes consult
// task_should_compute_output), while a hook on each intermediate keeps the gradients that flowed into it. W runs the
// engine from the intermediates, with those gradients, to the parameters alone. Each weight gradient is computed
// once and no activation gradient twice, whatever a layer is made of.
namespace ag = torch::autograd;

// The gradients that flowed into each intermediate during I.
struct CapturedGrads {
  std::vector<ag::variable_list> grads;  // per intermediate
  bool open = true;                      // W runs the intermediates again, and their hooks with them: nothing to keep
};

class CaptureGrads final : public ag::FunctionPreHook {
 public:
  CaptureGrads(std::shared_ptr<CapturedGrads> sink, std::size_t index) : sink_(std::move(sink)), index_(index) {}
  ag::variable_list operator()(const ag::variable_list& grads) override {
    if (sink_->open) sink_->grads[index_] = grads;
    return grads;
  }

 private:
  std::shared_ptr<CapturedGrads> sink_;  // not the node: the node owns this hook
  std::size_t index_;
};

// W's work for one micro-batch. Parameters that share an intermediate (a convolution's weight and bias) are one
// group, and each group is one run of the engine: a run from every intermediate at once would compute the gradients
// between them (a batch norm's input gradient leads to the convolution below it, whose weight is asked for).
struct WeightPass {
  struct Group {
    std::vector<std::size_t> intermediates;  // indices into `nodes`
    ag::edge_list parameters;                // the parameters' gradient edges (their AccumulateGrad nodes)
  };
  std::vector<std::shared_ptr<ag::Node>> nodes;  // the intermediates; they hold the part of the graph W needs
  std::vector<Group> groups;
  std::shared_ptr<CapturedGrads> captured = std::make_shared<CapturedGrads>();
};

enum class Split {
  input_and_weights,  // I: the input's gradient; W: the weights' from the intermediates
  all_in_weights,     // the input is not in the graph (the first stage): I has nothing to send, W does the backward
  all_in_input,       // no clean split (below): I runs the whole backward, W has nothing left
};

// Finds the intermediates of `output`'s graph between `input` and `parameters`, groups the parameters by them and, for
// input_and_weights, hooks each intermediate. all_in_input where a group's intermediates lead to one another (a
// weight used twice on the input's path, one use below the other): W from both would compute the gradient between
// them, and count it twice.
Split plan_split(const at::Tensor& output, const at::Tensor& input, const std::vector<at::Tensor>& parameters,
                 WeightPass& pass) {
  // The graph reachable from the output, with its edges reversed: who consumes each node's gradient.
  std::unordered_map<ag::Node*, std::vector<ag::Node*>> consumers;
  const ag::Edge output_edge = ag::impl::gradient_edge(output);  // an output that is a leaf gets its AccumulateGrad
  ag::Node* const root = output_edge.function.get();             // here, owned by this edge alone
  consumers[root];
  for (std::vector<ag::Node*> todo{root}; !todo.empty();) {
    ag::Node* n = todo.back();
    todo.pop_back();
    for (const ag::Edge& e : n->next_edges()) {
      if (!e.is_valid()) continue;
      auto [it, fresh] = consumers.try_emplace(e.function.get());
      it->second.push_back(n);
      if (fresh) todo.push_back(e.function.get());
    }
  }
  const auto input_node = input.requires_grad() ? ag::impl::try_get_grad_accumulator(input) : nullptr;
  if (!input_node || !consumers.count(input_node.get())) return Split::all_in_weights;

  // The nodes that depend on the input (those that lead to it): what I runs.
  std::unordered_set<ag::Node*> on_input_path{input_node.get()};
  for (std::vector<ag::Node*> todo{input_node.get()}; !todo.empty();) {
    ag::Node* n = todo.back();
    todo.pop_back();
    for (ag::Node* c : consumers[n])
      if (on_input_path.insert(c).second) todo.push_back(c);
  }

  // Each parameter's intermediates: up from its AccumulateGrad through the nodes that do not depend on the input,
  // to the first ones that do. Parameters that share an intermediate are joined (union-find over intermediates).
  std::unordered_map<ag::Node*, std::size_t> index;  // intermediate -> its index in pass.nodes
  std::vector<std::size_t> parent;
  auto find = [&](std::size_t i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
  };
  std::vector<std::pair<std::shared_ptr<ag::Node>, std::size_t>> used;  // (AccumulateGrad, one of its intermediates)
  for (const at::Tensor& p : parameters) {
    auto acc = ag::impl::try_get_grad_accumulator(p);
    if (!acc || !consumers.count(acc.get())) continue;  // not used by this stage's graph
    std::unordered_set<ag::Node*> seen{acc.get()};
    std::vector<std::size_t> mine;
    for (std::vector<ag::Node*> todo{acc.get()}; !todo.empty();) {
      ag::Node* n = todo.back();
      todo.pop_back();
      for (ag::Node* c : consumers[n]) {
        if (!seen.insert(c).second) continue;
        if (!on_input_path.count(c)) {
          todo.push_back(c);
          continue;
        }
        auto [it, fresh] = index.try_emplace(c, pass.nodes.size());
        if (fresh) {
          pass.nodes.push_back(c->shared_from_this());
          parent.push_back(it->second);
        }
        mine.push_back(it->second);
      }
    }
    // Not expected: the output depends on the input, so the last node on the way from it to the parameter that does
    // is an intermediate. Without one, only the whole backward is sure to reach the parameter.
    if (mine.empty()) return Split::all_in_input;
    for (std::size_t m : mine) parent[find(m)] = find(mine.front());
    used.emplace_back(std::move(acc), mine.front());
  }

  std::map<std::size_t, std::size_t> group_of;  // union-find root -> index in pass.groups
  auto group = [&](std::size_t intermediate) -> WeightPass::Group& {
    auto [it, fresh] = group_of.try_emplace(find(intermediate), pass.groups.size());
    if (fresh) pass.groups.emplace_back();
    return pass.groups[it->second];
  };
  for (std::size_t i = 0; i < pass.nodes.size(); ++i) group(i).intermediates.push_back(i);
  for (auto& [acc, i] : used) group(i).parameters.emplace_back(std::move(acc), 0);

  // A group's intermediates must not lead to one another through the nodes on the input's path.
  for (const WeightPass::Group& g : pass.groups) {
    if (g.intermediates.size() < 2) continue;
    std::unordered_set<ag::Node*> mine;
    for (std::size_t i : g.intermediates) mine.insert(pass.nodes[i].get());
    for (std::size_t i : g.intermediates) {
      std::unordered_set<ag::Node*> seen;
      for (std::vector<ag::Node*> todo{pass.nodes[i].get()}; !todo.empty();) {
        ag::Node* n = todo.back();
        todo.pop_back();
        for (const ag::Edge& e : n->next_edges()) {
          ag::Node* next = e.function.get();
          if (!next || !on_input_path.count(next) || !seen.insert(next).second) continue;
          if (mine.count(next)) return Split::all_in_input;
          todo.push_back(next);
        }
      }
    }
  }

  pass.captured->grads.resize(pass.nodes.size());
  for (std::size_t i = 0; i < pass.nodes.size(); ++i)
    pass.nodes[i]->add_pre_hook(std::make_unique<CaptureGrads>(pass.captured, i));
  return Split::input_and_weights;
}

// W: one engine run per group, from the gradients captured at its intermediates to its parameters' AccumulateGrad.
// The graph is not kept: every node it runs belongs to this group alone.
void run_weight_pass(WeightPass& pass) {
  pass.captured->open = false;
  for (const WeightPass::Group& g : pass.groups) {
    ag::edge_list roots;
    ag::variable_list grads;
    for (std::size_t i : g.intermediates) {
      ag::variable_list& in = pass.captured->grads[i];
      for (std::size_t k = 0; k < in.size(); ++k) {
        if (!in[k].defined()) continue;  // no gradient reached that input of the node in I
        roots.emplace_back(pass.nodes[i], static_cast<std::uint32_t>(k));
        grads.push_back(std::move(in[k]));
      }
    }
    if (roots.empty()) continue;  // the gradient stopped before this group: its weights get none, as in a backward
    ag::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false,
                                             /*accumulate_grad=*/true, g.parameters);
  }
  pass.captured->grads.clear();
}

// One micro-batch on one stage, from its forward to the end of its backward.
struct Held {
  at::Tensor input;   // a leaf that requires grad, except on the first stage
  at::Tensor output;  // the stage's output; on the last stage, the scaled loss
  // Zero bubble, from I to W: the intermediates and their gradients, or (all_in_weights) the output's gradient.
  std::unique_ptr<WeightPass> weights;
  ag::variable_list output_grad;
};

struct Host {
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
  return rpc_async<&deliver>(to, host.placement.pipeline_id, step, stage, micro, gradient, std::move(value));
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

Task<WorkerReport> run_step(std::uint64_t id, std::int64_t step, std::vector<Action> actions,
                            std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets, std::int64_t mean_over) {
  auto host = host_or_throw(id);
  host->forget_before(step);
  const int last = static_cast<int>(host->placement.stage_ranks.size()) - 1;
  WorkerReport report;
  report.rank = host->rank;
  for (auto& [s, st] : host->stages) {
    report.stages.push_back(s);
    // This step's gradients only. Zeroed rather than dropped: they stay allocated from the first step on, so the
    // activation peak below does not count them.
    for (auto& p : st.layers->parameters())
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  report.losses.assign(targets.size(), 0.0);
  reset_host_peak_bytes();
  const std::int64_t baseline = host_live_bytes();

  std::map<std::pair<int, int>, Held> held;
  std::vector<Future<void>> sends;
  for (const Action& a : actions) {
    auto found = host->stages.find(a.stage);
    if (found == host->stages.end())
      throw UsageError("action for stage " + std::to_string(a.stage) + " not hosted here");
    HostedStage& st = found->second;
    const std::pair<int, int> key{a.stage, a.micro};
    const bool first_stage = a.stage == 0, last_stage = a.stage == last;
    ActionRecord record;
    record.action = a;
    record.rank = host->rank;

    if (a.kind == ActionKind::Forward) {
      at::Tensor x;  // (no co_await inside ?: : GCC 12 miscompiles temporaries there)
      if (first_stage) x = inputs.at(a.micro);
      else x = co_await host->receive({step, a.stage, a.micro, false});
      record.start_ns = now_ns();
      Held h;
      x = x.to(st.device).detach();
      if (!first_stage && x.is_floating_point()) x.requires_grad_(true);
      h.input = x;
      at::Tensor y = x;
      for (auto& layer : *st.layers) y = layer.forward(y);
      if (last_stage) {
        const at::Tensor& target = targets.at(a.micro);
        // A mean over the batch is the sum of the micro-batches' means weighted by their shares; a sum needs none.
        const double share = mean_over > 0 ? static_cast<double>(target.size(0)) / static_cast<double>(mean_over) : 1.0;
        h.output = host->loss(y, target.to(st.device)) * share;
        report.losses[a.micro] = h.output.item<double>();
      } else {
        h.output = y;
        sends.push_back(send(*host, step, a.stage + 1, a.micro, false, y.detach()));
      }
      held.emplace(key, std::move(h));
      report.peak_micro_batches_held =
          std::max<std::int32_t>(report.peak_micro_batches_held, static_cast<std::int32_t>(held.size()));
    } else if (a.kind == ActionKind::Backward || a.kind == ActionKind::BackwardInput) {
      at::Tensor g;
      if (!last_stage) g = co_await host->receive({step, a.stage, a.micro, true});
      record.start_ns = now_ns();
      auto it = held.find(key);
      if (it == held.end()) throw UsageError("backward before forward for stage " + std::to_string(a.stage));
      Held& h = it->second;
      torch::autograd::variable_list grad_out;
      if (g.defined()) grad_out.push_back(g.to(st.device));
      at::Tensor input_grad;
      if (a.kind == ActionKind::Backward) {
        if (h.output.requires_grad()) torch::autograd::backward({h.output}, grad_out);
        if (!first_stage) input_grad = grad_or_zeros(h.input);
        held.erase(it);
      } else if (!h.output.requires_grad()) {
        if (!first_stage) input_grad = at::zeros_like(h.input);
        h.output = at::Tensor();  // nothing for W either
      } else {
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
      }
      if (!first_stage) sends.push_back(send(*host, step, a.stage - 1, a.micro, true, input_grad.detach()));
    } else {  // W: what I left (see plan_split)
      record.start_ns = now_ns();
      auto it = held.find(key);
      if (it == held.end()) throw UsageError("W before I for stage " + std::to_string(a.stage));
      Held& h = it->second;
      if (h.weights) run_weight_pass(*h.weights);
      else if (h.output.defined()) torch::autograd::backward({h.output}, h.output_grad);
      held.erase(it);
    }
    record.end_ns = now_ns();
    report.records.push_back(record);
    if (trace::enabled()) [[unlikely]] {
      trace::detail::record({.kind = trace::detail::Kind::pipeline_action,
                             .t0 = record.start_ns,
                             .t1 = record.end_ns,
                             .name = action_letter(a.kind) + std::to_string(a.micro) + "/s" + std::to_string(a.stage)});
    }
  }
  co_await when_all(std::move(sends));
  for (auto& [s, st] : host->stages)
    if (st.optimizer) st.optimizer->step();
  report.peak_activation_bytes = host_peak_bytes() - baseline;
  co_return report;
}

std::uint64_t next_pipeline_id() {
  static std::atomic<std::uint32_t> counter{0};
  return (static_cast<std::uint64_t>(get_worker_info().rank) << 32) | ++counter;
}

}  // namespace corpc::pipeline::detail
