#pragma once

#include <torch/csrc/autograd/function.h>

#include <memory>
#include <vector>

#include "corpc/detail/torch_compat.hpp"

namespace corpc::pipeline::detail {

// Zero bubble's split backward: I (the stage input's gradient) and W (the weights' gradients) as two runs of
// libtorch's autograd engine over one micro-batch's graph.
//
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

// W's work for one micro-batch. Parameters that share an intermediate (a convolution's weight and bias) are one
// group, and each group is one run of the engine: a run from every intermediate at once would compute the gradients
// between them (a batch norm's input gradient leads to the convolution below it, whose weight is asked for).
struct WeightPass {
  struct Group {
    std::vector<std::size_t> intermediates;  // indices into `nodes`
    ag::edge_list parameters;                // the parameters' gradient edges (their AccumulateGrad nodes)
  };
  std::vector<corpc::detail::NodeRef<ag::Node>> nodes;  // the intermediates; they hold the part of the graph W needs
  std::vector<Group> groups;
  std::shared_ptr<CapturedGrads> captured = std::make_shared<CapturedGrads>();
};

enum class Split {
  input_and_weights,  // I: the input's gradient; W: the weights' from the intermediates
  all_in_weights,     // the input is not in the graph (the first stage): I has nothing to send, W does the backward
  all_in_input,       // no clean split (see plan_split): I runs the whole backward, W has nothing left
};

// Finds the intermediates of `output`'s graph between `input` and `parameters`, groups the parameters by them and, for
// input_and_weights, hooks each intermediate (the hooks fill pass.captured during I).
Split plan_split(const at::Tensor& output, const at::Tensor& input, const std::vector<at::Tensor>& parameters,
                 WeightPass& pass);

// W: one engine run per group, from the gradients captured at its intermediates to its parameters.
void run_weight_pass(WeightPass& pass);

}  // namespace corpc::pipeline::detail
