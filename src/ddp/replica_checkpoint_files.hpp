// The stage files of a replica checkpoint (see corpc/ddp/replica_checkpoint.hpp): what one stage's file holds, made
// on the training thread and written on a thread of its own; read back for a job or for a whole model.
#pragma once

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <string>

namespace corpc::ddp::ckpt_detail {

// Which stage a file is, and which of the whole model's layers it holds.
struct StageMeta {
  std::int64_t step = 0;
  int stage = 0, stages = 0;
  int first_layer = 0, layers = 0;  // layers [first_layer, first_layer + layers) of the whole model
};

// A copy of `layers` (their parameters and buffers, cloned) and `optimizer`'s state (serialised to bytes), with
// `meta`: the archive of one stage's file, independent of the live stage once made.
torch::serialize::OutputArchive snapshot_stage(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
                                               const StageMeta& meta);

// Writes `archive` as stage meta.stage's file in `step_dir` (made if missing), under a temporary name renamed into
// place. RpcError if it cannot.
void write_stage(torch::serialize::OutputArchive& archive, const std::string& step_dir, const StageMeta& meta);

// The path of stage `stage` of `stages` in `step_dir`.
std::string stage_file(const std::string& step_dir, int stage, int stages);

// A stage's file, read: its meta, its layers' archive ("3" -> {"weight", ...}) and its optimizer's.
struct StageFile {
  StageMeta meta;
  torch::serialize::InputArchive layers, optimizer;
};
// Reads stage `stage` of `stages` from `step_dir`. UsageError naming the file if it is missing, not a stage file, or
// another stage's.
StageFile read_stage(const std::string& step_dir, int stage, int stages);

// UsageError naming `where` unless `in` has every parameter, buffer and child of `module` with its shapes (a load
// would otherwise take other shapes silently).
void check_loadable(const torch::nn::Module& module, torch::serialize::InputArchive& in, const std::string& where);

// The number of stages of the checkpoint in `step_dir` (from its file names); UsageError if it has no stage file.
int stage_count(const std::string& step_dir);

}  // namespace corpc::ddp::ckpt_detail
