// DDP + RPC (PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"), on corpc: a master, a
// parameter server holding an EmbeddingBag as a RemoteModule, and two trainers, each running the embedding lookup
// remotely and a DDP-wrapped Linear locally, backward with distributed autograd and a DistributedOptimizer over the
// embedding's remote parameters and the Linear's local ones.
//
//   ranks: 0, 1 trainers ("trainer0", "trainer1"), 2 master ("master"), 3 parameter server ("ps"), as in the tutorial.
//   corpc::RemoteModule<torch::nn::EmbeddingBag> table(corpc::remote<&make_embedding_table>("ps", seed));  // master
//   corpc::rpc_async<&run_trainer>("trainer0", table, 0, config);                    // starts a trainer's loop
#pragma once

#include <corpc/corpc.hpp>
#include <corpc/rref/remote_module.hpp>
#include <torch/nn/modules/embedding.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

namespace systems::hybrid {

inline constexpr std::int64_t kEmbeddings = 100, kEmbeddingDim = 16, kClasses = 8;
inline constexpr int kTrainers = 2;

struct Config {
  std::uint64_t seed = 0;
  std::int64_t steps = 100;
  double lr = 0.05;
  // After each step, the trainers wait for each other (a barrier on their process group), so that every forward
  // sees both trainers' previous embedding updates: the run is then reproducible (tests). The tutorial does not.
  bool lockstep = false;
  std::string group_prefix = "corpc/hybrid/";  // the trainers' keys in the rendezvous store
  // Time each phase of a step (kPhases) on the trainers: TrainerResult::phase_seconds. Off, the loop reads no clock
  // inside a step.
  bool phases = false;
  CORPC_FIELDS(seed, steps, lr, lockstep, group_prefix, phases)
};

// EmbeddingBag(100, 16, mode sum) on the parameter server, its weight from `seed`.
torch::nn::EmbeddingBag make_embedding_table(std::uint64_t seed);
// The dense part's initial [weight, bias] of Linear(16, 8).
std::vector<at::Tensor> initial_dense(std::uint64_t seed);

// The tutorial's random batch: 20–50 indices in bags of 1–10, a class per bag; step `step` of `trainer`.
struct Batch {
  at::Tensor indices, offsets, target;
};
Batch make_batch(std::uint64_t seed, int trainer, std::int64_t step);

// The phases of a trainer's step, in order, as Config::phases times them: the batch; opening the distributed autograd
// context; the embedding lookup on the server (one RPC); the DDP Linear's forward; the loss; backward (the local
// pass and DDP's allreduce, and the embedding's gradient sent to the server, whose pass there it waits for); the
// DistributedOptimizer's step (the server's and this trainer's optimizers); the context's release at scope exit; the
// lockstep barrier.
inline constexpr const char* kPhases[] = {"batch",    "context", "lookup",  "dense",  "loss",
                                          "backward", "step",    "release", "barrier"};
inline constexpr std::size_t kPhaseCount = std::size(kPhases);

struct TrainerResult {
  std::vector<at::Tensor> dense;      // the trainer's Linear [weight, bias] after training
  double seconds = 0;                 // the training loop alone
  std::vector<double> phase_seconds;  // Config::phases: the seconds spent in each of kPhases, summed over the steps
  // Config::phases: after training, the mean seconds of one allreduce of the dense gradients' size on the trainers'
  // process group alone (c10d, Gloo): the floor under the backward phase, which waits for DDP's allreduce.
  double bare_allreduce_seconds = 0;
  CORPC_FIELDS(dense, seconds, phase_seconds, bare_allreduce_seconds)
};

// A trainer's loop (started by the master over RPC, which hands it the remote module). Joins the trainers' DDP
// process group on first use.
TrainerResult run_trainer(corpc::RemoteModule<torch::nn::EmbeddingBag> table, int trainer, Config config);

// The parameters of the table (for checks): its weight.
at::Tensor table_weight(const corpc::RemoteModule<torch::nn::EmbeddingBag>& table);

// The same training in one process: every step, each trainer's batch through the same parameters; the dense part
// steps with the mean of the two trainers' gradients (what DDP computes), the embedding with each trainer's gradient
// in turn (what two DistributedOptimizers do on the parameter server). Returns [embedding weight, dense weight, bias].
std::vector<at::Tensor> reference(const Config& config);

}  // namespace systems::hybrid
