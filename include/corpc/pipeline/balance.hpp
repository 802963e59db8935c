/// @file
/// Cutting a torch::nn::Sequential into pipeline stages.
///
/// ```cpp
///   std::vector<int> balance = corpc::pipeline::balance_by_time(model, sample_batch, /*stages=*/4);
///   // balance[s] = number of consecutive layers of stage s; every layer is on exactly one stage
/// ```
///
/// balance_by_time profiles each layer's forward and backward on the sample (as torchgpipe's balance_by_time does),
/// then cuts the layers into consecutive groups that minimize the slowest stage's time: the pipeline's pace.
/// refine_balance corrects that profile with the stage times of real steps (a step's timeline), round by round:
///
/// ```cpp
///   std::vector<double> costs = corpc::pipeline::profile_layers(model, sample);
///   o.balance = corpc::pipeline::partition_by_cost(costs, 2);
///   for (int round = 0; round < 3; ++round) {
///     auto pipe = corpc::pipeline::Pipeline::create<&make_model, &mse, &make_sgd>(o, ...);
///     auto step = corpc::sync_wait(pipe.train_step(images, labels));
///     auto next = corpc::pipeline::refine_balance(costs, o.balance, corpc::pipeline::stage_busy_seconds(step.workers, 2));
///     if (next == o.balance) break;
///     o.balance = next;
///   }
/// ```
#pragma once

#include <torch/autograd.h>
#include <torch/nn/modules/container/sequential.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <vector>

#include "corpc/pipeline/partition.hpp"
#include "corpc/pipeline/schedule_balance.hpp"
#include "corpc/rpc/errors.hpp"

namespace corpc::pipeline {

/// Each layer's forward plus backward time on `sample` (seconds; the median of `repeats` runs after one warm-up),
/// layer by layer, the input of each layer being the previous layer's output.
inline std::vector<double> profile_layers(torch::nn::Sequential model, const at::Tensor& sample, int repeats = 3) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> times;
  at::Tensor x = sample;
  for (auto& layer : *model) {
    std::vector<double> runs;
    at::Tensor y;
    for (int i = 0; i <= repeats; ++i) {
      at::Tensor in = x.detach().requires_grad_(x.is_floating_point());
      const auto t0 = Clock::now();
      y = layer.forward(in);
      if (y.requires_grad()) torch::autograd::backward({y}, {at::ones_like(y)});
      if (i > 0) runs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::nth_element(runs.begin(), runs.begin() + static_cast<long>(runs.size() / 2), runs.end());
    times.push_back(runs[runs.size() / 2]);
    x = y.detach();
  }
  for (auto& p : model->parameters()) p.mutable_grad().reset();  // profiling leaves no gradients behind
  return times;
}

/// Each layer's forward (F), input-gradient (I) and weight-gradient (W) seconds for one micro-batch `sample`, what
/// balance_for_schedule (schedule_balance.hpp) simulates a schedule with: the median of `repeats` runs after one
/// warm-up, layer by layer, the input of each layer being the previous layer's output. I and W are split as zero
/// bubble splits a stage's backward (at the nodes where an activation's gradient meets a weight); a layer where that
/// split finds nothing apart counts its whole backward in I. The first layer's input needs no gradient, as the first
/// stage's does not: its backward is all W. Profile at the micro-batch size the pipeline will run (the batch over
/// PipelineOptions::micro_batches): per image, small convolutions cost more than large ones. `wait`, if given, runs
/// before each clock reading (on a GPU: a synchronize, or the clock reads when kernels were queued). Leaves no
/// gradients behind. The model must be in the mode it will train in.
std::vector<ActionCosts> profile_layer_costs(torch::nn::Sequential model, const at::Tensor& sample, int repeats = 3,
                                             const std::function<void()>& wait = {});

/// torchgpipe's balance-by-time: profile, then partition_by_cost. The model must be in the mode it will train in.
inline std::vector<int> balance_by_time(torch::nn::Sequential model, const at::Tensor& sample, int stages,
                                        int repeats = 3) {
  return partition_by_cost(profile_layers(model, sample, repeats), stages);
}

/// Corrects a profile with the stage times one real step measured, and cuts again. Every layer of stage s has its
/// cost scaled by measured[s] / predicted[s] (predicted: the sum of its layers' costs), so `costs` becomes this
/// setting's costs and rounds compound. A profile taken one layer at a time misses what a running stage pays: its
/// activations no longer in cache when backward comes, messages, the loss; the error is mostly per stage, which is
/// what the scaling corrects. `measured` comes from the step's timeline (stage_busy_seconds in timeline.hpp); a
/// stage measured at 0 (it ran nothing) keeps its costs. Returns the new balance; the same one means it converged.
inline std::vector<int> refine_balance(std::vector<double>& costs, const std::vector<int>& balance,
                                       const std::vector<double>& measured) {
  if (balance.size() != measured.size())
    throw UsageError("refine_balance: " + std::to_string(measured.size()) + " measured stages for a balance of " +
                     std::to_string(balance.size()));
  std::size_t layers = 0;
  for (int b : balance) layers += b > 0 ? static_cast<std::size_t>(b) : costs.size() + 1;
  if (layers != costs.size()) throw UsageError("refine_balance: the balance does not cover the layers one to one");
  std::size_t first = 0;
  for (std::size_t s = 0; s < balance.size(); ++s) {
    const std::size_t end = first + static_cast<std::size_t>(balance[s]);
    double predicted = 0;
    for (std::size_t i = first; i < end; ++i) predicted += costs[i];
    if (measured[s] > 0 && predicted > 0)
      for (std::size_t i = first; i < end; ++i) costs[i] *= measured[s] / predicted;
    first = end;
  }
  return partition_by_cost(costs, static_cast<int>(balance.size()));
}

/// Layers [begin, end) of `model` as a Sequential of their own, sharing the layers (and parameters) with `model`;
/// each keeps its name, so parameter names match the unsplit model's.
inline torch::nn::Sequential slice_layers(torch::nn::Sequential model, std::size_t begin, std::size_t end) {
  torch::nn::Sequential part;
  const auto names = model->named_children();
  if (end > model->size() || begin > end) throw UsageError("layer range out of the model");
  for (std::size_t i = begin; i < end; ++i) part->push_back(names[i].key(), *(model->begin() + static_cast<long>(i)));
  return part;
}

}  // namespace corpc::pipeline
