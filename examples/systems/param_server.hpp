// Parameter servers from PyTorch's tutorials, on corpc: an MNIST-sized MLP (784-128-10) trained by several trainers
// on synthetic data, its parameters held by one server.
//
//   auto ps = corpc::remote<BatchUpdatingParameterServer>("ps", trainers, seed, lr);   // on the server
//   rpc_async<&run_trainer<BatchUpdatingParameterServer>>("trainer1", ps, 1, steps, seed);   // on each trainer
//
// Both servers answer the same two calls, so one trainer loop drives either:
//   get_parameters()                 -> the current parameters and their version (number of updates applied)
//   update_and_fetch(trainer, grads) -> the parameters after this gradient has been applied
// AsyncParameterServer applies each gradient as it arrives (one SGD step per call, under a lock) and answers at once.
// BatchUpdatingParameterServer sums the gradients of one round (one per trainer), applies their mean in one SGD
// step when the last of them arrives, and only then completes every trainer's call with the new parameters: its
// update_and_fetch returns a Future, so a waiting trainer holds no thread on the server (PyTorch needs
// @rpc.functions.async_execution for this).
#pragma once

#include <ATen/core/Tensor.h>
#include <corpc/corpc.hpp>
#include <corpc/rref/rref.hpp>

#include <cstdint>
#include <mutex>
#include <vector>

namespace systems::ps {

inline constexpr std::int64_t kInputs = 784, kHidden = 128, kClasses = 10, kBatch = 32;

// The parameters [w1, b1, w2, b2] of Linear(784, 128) -> ReLU -> Linear(128, 10), initialised as torch::nn::Linear
// does, from `seed`.
std::vector<at::Tensor> init_parameters(std::uint64_t seed);
at::Tensor mlp_forward(const std::vector<at::Tensor>& params, const at::Tensor& x);

// Synthetic MNIST-shaped data: Gaussian inputs labelled by a fixed random linear "teacher" (the same for every
// seed-sharing process), so the task is learnable. Batch `step` of trainer `trainer` is the same on every run.
struct Batch {
  at::Tensor x, y;
};
Batch synthetic_batch(std::uint64_t seed, int trainer, std::int64_t step, std::int64_t batch = kBatch);
Batch held_out_batch(std::uint64_t seed, std::int64_t n = 512);

// Cross-entropy gradients of the parameters on one batch (local autograd); `loss` gets the batch loss if not null.
std::vector<at::Tensor> gradients(const std::vector<at::Tensor>& params, const Batch& batch, float* loss = nullptr);
// Plain SGD: p -= lr * g, in place.
void sgd_step(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads, double lr);
float accuracy(const std::vector<at::Tensor>& params, const Batch& batch);

struct Snapshot {
  std::int64_t version = 0;  // updates applied before these parameters
  std::vector<at::Tensor> params;
  CORPC_FIELDS(version, params)
};

class AsyncParameterServer {
 public:
  AsyncParameterServer(std::uint64_t seed, double lr);
  Snapshot get_parameters();
  Snapshot update_and_fetch(int trainer, std::vector<at::Tensor> grads);
  std::int64_t updates();

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> params_;
  double lr_;
  std::int64_t version_ = 0;
};

class BatchUpdatingParameterServer {
 public:
  BatchUpdatingParameterServer(int trainers, std::uint64_t seed, double lr);
  Snapshot get_parameters();
  // Completes when every trainer has sent its gradient for this round. A trainer that sends twice in one round gets
  // a UsageError (it would otherwise wait for a round that its second call cannot finish).
  corpc::Future<Snapshot> update_and_fetch(int trainer, std::vector<at::Tensor> grads);
  std::int64_t updates();
  int pending();  // gradients received in the current round

 private:
  std::mutex mutex_;
  std::vector<at::Tensor> params_;
  double lr_;
  std::int64_t version_ = 0;
  // Gradients of the current round by trainer, summed in trainer order when the round is full, so that the result
  // does not depend on arrival order.
  std::vector<std::vector<at::Tensor>> round_;
  int received_ = 0;
  corpc::Promise<Snapshot> round_done_;
};

struct TrainerResult {
  std::int64_t steps = 0;
  std::vector<std::int64_t> versions;  // the version each update_and_fetch answered with, in order
  float last_loss = 0;
  CORPC_FIELDS(steps, versions, last_loss)
};

// One trainer's loop (started by the master over RPC, as in the tutorial): fetch, compute gradients, push, repeat.
template <class Server>
corpc::Task<TrainerResult> run_trainer(corpc::RRef<Server> ps, int trainer, std::int64_t steps, std::uint64_t seed) {
  TrainerResult out;
  Snapshot snap = co_await ps.template rpc_async<&Server::get_parameters>();
  for (std::int64_t step = 0; step < steps; ++step) {
    auto grads = gradients(snap.params, synthetic_batch(seed, trainer, step), &out.last_loss);
    snap = co_await ps.template rpc_async<&Server::update_and_fetch>(trainer, std::move(grads));
    out.versions.push_back(snap.version);
    ++out.steps;
  }
  co_return out;
}

// The batch-updating server's computation in one process: each round, every trainer's gradient at the same
// parameters, summed in trainer order, averaged, one SGD step.
std::vector<at::Tensor> reference_batch_updating(int trainers, std::int64_t rounds, std::uint64_t seed, double lr);

}  // namespace systems::ps
