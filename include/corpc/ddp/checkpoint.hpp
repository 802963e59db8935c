/// @file
/// Checkpointing a DDP model as PyTorch's DDP notes describe it.
///
/// ```cpp
///   corpc::ddp::save_checkpoint(*ddp.module(), &opt, "/tmp/model.pt", *group);   // rank 0 writes, all wait
///   corpc::ddp::load_checkpoint(*ddp.module(), &opt, "/tmp/model.pt");           // every rank reads
/// ```
///
/// Only rank 0 writes (all ranks hold the same weights under DDP); a barrier keeps the others from reading a file
/// that is still being written. `device` maps the saved tensors, as map_location does in Python.
///
/// Loading into a module already wrapped in DistributedDataParallel is fine: libtorch's loader gives each parameter
/// a new gradient accumulator (set_), and DDP re-attaches its hooks to the current ones before every forward.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <optional>
#include <string>

namespace corpc::ddp {

/// Rank 0 saves module (and optimizer, if given) to path; then every rank waits at a barrier.
void save_checkpoint(torch::nn::Module& module, torch::optim::Optimizer* optimizer, const std::string& path,
                     c10d::ProcessGroup& group);

/// Loads what save_checkpoint wrote into module (and optimizer), onto `device` if given.
void load_checkpoint(torch::nn::Module& module, torch::optim::Optimizer* optimizer, const std::string& path,
                     std::optional<torch::Device> device = std::nullopt);

/// The three steps of the DDP notes: rank 0 saves, all wait, all load.
inline void save_and_reload(torch::nn::Module& module, torch::optim::Optimizer* optimizer, const std::string& path,
                            c10d::ProcessGroup& group, std::optional<torch::Device> device = std::nullopt) {
  save_checkpoint(module, optimizer, path, group);
  load_checkpoint(module, optimizer, path, device);
}

}  // namespace corpc::ddp
