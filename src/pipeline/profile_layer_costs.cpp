// Each layer's F, I and W seconds for balance_for_schedule (see corpc/pipeline/balance.hpp).
#include <torch/autograd.h>

#include <algorithm>
#include <chrono>

#include "corpc/pipeline/balance.hpp"

#include "pipeline/split_backward.hpp"

namespace corpc::pipeline {

namespace {

double median(std::vector<double> runs) {
  if (runs.empty()) return 0;
  std::nth_element(runs.begin(), runs.begin() + static_cast<long>(runs.size() / 2), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace

std::vector<ActionCosts> profile_layer_costs(torch::nn::Sequential model, const at::Tensor& sample, int repeats,
                                             const std::function<void()>& wait) {
  using Clock = std::chrono::steady_clock;
  auto now = [&] {
    if (wait) wait();
    return Clock::now();
  };
  auto seconds = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
  std::vector<ActionCosts> costs;
  at::Tensor x = sample;
  bool first = true;
  for (auto& layer : *model) {
    std::vector<at::Tensor> params;
    for (auto& p : layer.ptr()->parameters())
      if (p.requires_grad()) params.push_back(p);
    std::vector<double> f, i_runs, w_runs;
    at::Tensor y;
    for (int run = 0; run <= repeats; ++run) {
      at::Tensor in = x.detach();
      if (!first && in.is_floating_point()) in.requires_grad_(true);  // the first stage's input needs no gradient
      auto t0 = now();
      y = layer.forward(in);
      auto t1 = now();
      double input = 0, weight = 0;
      if (y.requires_grad()) {
        // What the Pipeline's I and W run (pipeline_stages.cpp), on this layer alone.
        detail::WeightPass pass;
        torch::autograd::variable_list grad_out{at::ones_like(y)};
        switch (detail::plan_split(y, in, params, pass)) {
          case detail::Split::input_and_weights: {
            auto g = torch::autograd::grad({y}, {in}, grad_out, /*retain_graph=*/true, /*create_graph=*/false,
                                           /*allow_unused=*/true);
            auto t2 = now();
            detail::run_weight_pass(pass);
            input = seconds(t1, t2), weight = seconds(t2, now());
            break;
          }
          case detail::Split::all_in_weights:
            torch::autograd::backward({y}, grad_out);
            weight = seconds(t1, now());
            break;
          case detail::Split::all_in_input:
            torch::autograd::backward({y}, grad_out);
            input = seconds(t1, now());
            break;
        }
      }
      if (run > 0) f.push_back(seconds(t0, t1)), i_runs.push_back(input), w_runs.push_back(weight);
    }
    costs.push_back({median(f), median(i_runs), median(w_runs)});
    x = y.detach();
    first = false;
  }
  for (auto& p : model->parameters()) p.mutable_grad().reset();  // profiling leaves no gradients behind
  return costs;
}

}  // namespace corpc::pipeline
