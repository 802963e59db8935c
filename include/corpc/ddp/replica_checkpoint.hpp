/// @file
/// Checkpoints of pipeline replicas (corpc/ddp/pipeline_replicas.hpp) that a user can take home: one directory per
/// committed step, one file per stage, loadable into one process's whole model or back into a job with another number
/// of replicas (or another schedule over the same cut).
///
/// ```cpp
///   // on every worker, after a step: the workers of one replica write, on a thread of their own
///   if (pp.committed_steps() % 100 == 0) pp.save_checkpoint("/ckpt");  // writes /ckpt/step-100/stage-S-of-K.pt
///   // a later job, on every worker, before its first step (any number of replicas, the same cut):
///   pp.load_checkpoint(corpc::ddp::latest_replica_checkpoint("/ckpt"));
///   // or the whole model in one process (parameters and buffers):
///   auto model = make_model(0);
///   std::int64_t step = corpc::ddp::load_replica_checkpoint(model, corpc::ddp::latest_replica_checkpoint("/ckpt"));
/// ```
///
/// **What a stage file holds.** A torch::serialize archive: the stage's layers under their names in the whole model
/// (as Module::save lays them out: "3" → {"weight", "bias"}), the stage's optimizer state (its own archive, as bytes),
/// and the step, the stage, the stage count and the stage's layer range, which a load checks. A stage's copies are
/// equal after a commit, so one copy is written: by the workers of the lowest replica that took part in the last
/// committed step.
///
/// **Written without stopping training.** save_checkpoint copies the stage's tensors and serialises its optimizer in
/// memory on the calling thread (a copy of the stage's weights and optimizer state), then writes the file on a thread
/// of its own, under a temporary name renamed into place when complete: a step directory holds a stage's file only
/// once it is whole, and latest_replica_checkpoint takes only directories with every stage's file.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>

namespace corpc::ddp {

/// Where the files of `step` go under `root`: root/step-N.
std::string replica_checkpoint_dir(const std::string& root, std::int64_t step);

/// The step directory under `root` with the highest step whose every stage's file is there; "" if there is none (or
/// no `root`).
std::string latest_replica_checkpoint(const std::string& root);

/// Loads every stage's parameters and buffers in `step_dir` (a directory save_checkpoint wrote) into `model`, the
/// whole Sequential the replicas were cut from, built the same way; returns the checkpoint's step. Optimizer state is
/// per stage and is not loaded here (PipelineReplicas::load_checkpoint loads it into a job). UsageError if a stage's
/// file is missing, the files disagree (steps, stage counts), or a layer of the model has no match in them or other
/// shapes; the model may be partly loaded then.
std::int64_t load_replica_checkpoint(torch::nn::Sequential model, const std::string& step_dir);

}  // namespace corpc::ddp
