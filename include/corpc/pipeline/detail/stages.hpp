// The stage machinery behind corpc/pipeline/pipeline.hpp: what a worker hosting stages runs
// (src/pipeline/pipeline_stages.cpp), and the calls between the caller and the workers. Pipeline replicas
// (src/ddp/pipeline_replicas.cpp) drive the same stages with their own steps. Not part of the public API.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "corpc/core/task.hpp"
#include "corpc/pipeline/action.hpp"
#include "corpc/pipeline/timeline.hpp"
#include "corpc/rpc/registry.hpp"
#include "corpc/wire/codec.hpp"

namespace corpc::pipeline::detail {

// The loss and the optimizer factory as the stages take them (the public names: pipeline::LossFn, OptimizerFactory).
using StageLoss = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
using StageOptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> params)>;

// Where the stages of one pipeline are (sent to each worker that hosts some).
struct StagePlacement {
  std::uint64_t pipeline_id = 0;
  std::vector<std::int32_t> stage_ranks;   // per stage
  std::vector<std::int32_t> balance;       // per stage
  std::vector<std::string> stage_devices;  // per stage
  CORPC_FIELDS(pipeline_id, stage_ranks, balance, stage_devices)
};

void host_stages(const StagePlacement& placement, torch::nn::Sequential model, StageLoss loss,
                 StageOptimizerFactory optimizer);
// mean_over: the batch size when the loss is a mean (each micro-batch's loss is scaled by its share), 0 for a sum.
Task<WorkerReport> run_step(std::uint64_t id, std::int64_t step, std::vector<Action> actions,
                            std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets, std::int64_t mean_over);
// A worker's own step over the stages it hosts for `id` (pipeline replicas run one on every worker, with no caller):
// the actions of `attempt` (the mailbox's key: a retried step gets a new one), without the optimizer step.
struct StageHooks {
  std::function<void(int stage)> stage_backward_done;    // the stage's gradients of this step are complete
  std::function<void(const Action& done)> after_action;  // after each action, and its stage_backward_done
};
Task<WorkerReport> run_local_step(std::uint64_t id, std::int64_t attempt, std::vector<Action> actions,
                                  std::vector<at::Tensor> inputs, std::vector<at::Tensor> targets,
                                  std::int64_t mean_over, const StageHooks& hooks);
// The stages this process hosts for `id`, in stage order; the optimizer is null without a factory.
struct LocalStage {
  int stage = 0;
  torch::nn::Sequential layers;
  torch::optim::Optimizer* optimizer = nullptr;
};
std::vector<LocalStage> local_stages(std::uint64_t id);
void deliver(std::uint64_t id, std::int64_t step, std::int32_t stage, std::int32_t micro, bool gradient,
             at::Tensor value);
void abort_step(std::uint64_t id, std::int64_t step, std::string reason);
void drop_stages(std::uint64_t id);
void set_training(std::uint64_t id, bool on);
std::vector<std::pair<std::int32_t, std::vector<at::Tensor>>> stage_parameters(std::uint64_t id);

template <auto Model, auto Loss, auto MakeOptimizer, class... A>
void create_stages(StagePlacement placement, A... args) {
  host_stages(placement, Model(std::move(args)...), Loss, MakeOptimizer);
}

std::uint64_t next_pipeline_id();

}  // namespace corpc::pipeline::detail

// Run on the I/O thread where their frame arrives: they hand a value to a waiting action, or fail its step.
CORPC_IO_THREAD_FUNCTION(&corpc::pipeline::detail::deliver);
CORPC_IO_THREAD_FUNCTION(&corpc::pipeline::detail::abort_step);
