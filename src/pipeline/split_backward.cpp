// Zero bubble's split backward (see split_backward.hpp).
#include "pipeline/split_backward.hpp"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace corpc::pipeline::detail {

namespace {

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

}  // namespace

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
  // (AccumulateGrad, one of its intermediates)
  std::vector<std::pair<corpc::detail::NodeRef<ag::Node>, std::size_t>> used;
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
          pass.nodes.push_back(corpc::detail::node_ref<ag::Node>(c));
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

}  // namespace corpc::pipeline::detail
