// The hooks on the parameters' gradient accumulators: the first one of a backward pass starts it (and arms the
// end-of-backward wait), each one puts its parameter's gradient into its bucket; and find_unused_parameters, which
// tells beforehand which accumulators a backward will not reach.
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <unordered_set>

#include "corpc/autograd/dist_autograd.hpp"

#include "ddp/gradient_sync.hpp"

namespace corpc::ddp {

// Hooks parameter i's gradient accumulator. A parameter's accumulator can change under DDP: loading a checkpoint
// (InputArchive's set_ on each parameter) gives it a new one, and a hook on the old one would never fire again,
// leaving that rank training alone. So before each forward the hooks follow the current accumulators.
void GradientSync::State::follow_accumulators() {
  std::weak_ptr<State> weak = weak_from_this();
  for (size_t i = 0; i < params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params[i]);
    if (acc == accumulators[i]) continue;
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_grad_ready(i);
          return outputs;
        }));
    std::lock_guard<std::mutex> lock(mutex);
    accumulators[i] = std::move(acc);
  }
}

void GradientSync::State::on_grad_ready(size_t i) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!sync) return;
  if (!in_backward) {
    in_backward = true;
    pass_context = dist_autograd::leaf_hooks::pass_context_id();
    reset_locked();
    for (size_t j = 0; j < unused.size(); ++j) {
      if (unused[j]) mark_ready_locked(j);
    }
    std::weak_ptr<State> weak = weak_from_this();
    auto finish = [weak] {
      if (auto self = weak.lock()) self->finish_backward();
    };
    if (pass_context >= 0) {
      dist_autograd::leaf_hooks::at_end_of_pass(std::move(finish));
    } else {
      torch::autograd::Engine::get_default_engine().queue_callback(std::move(finish));
    }
  }
  mark_ready_locked(i);
  const size_t before = next_launch;
  launch_ready_locked();
  launched_early += next_launch - before;
}

// PyTorch's find_unused_parameters: walk the autograd graph from the output; parameters whose accumulator is not
// on it will get no gradient in this backward, so their buckets need not wait for them.
void GradientSync::State::find_unused(const at::Tensor& output) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  if (output.grad_fn()) {
    stack.push_back(output.grad_fn().get());
    seen.insert(stack.back());
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
  std::lock_guard<std::mutex> lock(mutex);
  unused.assign(params.size(), false);
  for (size_t i = 0; i < params.size(); ++i) unused[i] = seen.count(accumulators[i].get()) == 0;
}

}  // namespace corpc::ddp
