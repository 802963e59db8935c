#include "hybrid.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <corpc/autograd/dist_autograd.hpp>
#include <corpc/autograd/optimizer.hpp>
#include <corpc/ddp/ddp.hpp>
#include <corpc/rref/remote_module.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <mutex>

namespace systems::hybrid {

namespace {

namespace F = torch::nn::functional;

at::Generator generator(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

std::int64_t randint(std::int64_t low, std::int64_t high, at::Generator& gen) {
  return at::randint(low, high, {1}, gen).item<std::int64_t>();
}

// The two trainers' process group: the first two RPC workers, on RPC's own rendezvous (no second port).
c10::intrusive_ptr<c10d::ProcessGroup> trainer_group(int trainer, const std::string& prefix) {
  static std::once_flag once;
  static c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::call_once(once, [&] {
    corpc::ddp::ProcessGroupOptions options;
    options.rank = trainer;
    options.world_size = kTrainers;
    options.store_prefix = prefix;
    group = corpc::ddp::init_process_group(options);
  });
  return group;
}

// The mean seconds of one allreduce of a tensor as large as `dense`'s parameters on `group` (both trainers call it).
double time_bare_allreduce(c10d::ProcessGroup& group, torch::nn::Linear& dense) {
  std::int64_t numel = 0;
  for (auto& p : dense->parameters()) numel += p.numel();
  std::vector<at::Tensor> buffer{at::zeros({numel})};
  group.barrier()->wait();
  constexpr int kWarmup = 20, kCalls = 500;
  std::chrono::steady_clock::time_point start;
  for (int i = 0; i < kWarmup + kCalls; ++i) {
    if (i == kWarmup) start = std::chrono::steady_clock::now();
    group.allreduce(buffer)->wait();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kCalls;
}

at::Tensor weight_of(corpc::RRef<torch::nn::EmbeddingBag> table) {
  return table.local_value()->weight.detach().clone();
}

}  // namespace

torch::nn::EmbeddingBag make_embedding_table(std::uint64_t seed) {
  torch::nn::EmbeddingBag table(torch::nn::EmbeddingBagOptions(kEmbeddings, kEmbeddingDim).mode(torch::kSum));
  auto gen = generator(seed * 31 + 1);
  torch::NoGradGuard no_grad;
  table->weight.copy_(at::randn({kEmbeddings, kEmbeddingDim}, gen));
  return table;
}

std::vector<at::Tensor> initial_dense(std::uint64_t seed) {
  auto gen = generator(seed * 31 + 2);
  const double bound = 1.0 / std::sqrt(static_cast<double>(kEmbeddingDim));
  return {at::empty({kClasses, kEmbeddingDim}).uniform_(-bound, bound, gen),
          at::empty({kClasses}).uniform_(-bound, bound, gen)};
}

Batch make_batch(std::uint64_t seed, int trainer, std::int64_t step) {
  auto gen =
      generator(seed * 1'000'003 + static_cast<std::uint64_t>(trainer) * 1'000'000 + static_cast<std::uint64_t>(step));
  const std::int64_t n = randint(20, 51, gen);
  auto indices = at::randint(0, kEmbeddings, {n}, gen);
  std::vector<std::int64_t> offsets;
  for (std::int64_t start = 0; start < n; start += randint(1, 11, gen)) offsets.push_back(start);
  auto target = at::randint(0, kClasses, {static_cast<std::int64_t>(offsets.size())}, gen);
  return {indices, at::tensor(offsets), target};
}

TrainerResult run_trainer(corpc::RemoteModule<torch::nn::EmbeddingBag> embedding, int trainer, Config config) {
  auto group = trainer_group(trainer, config.group_prefix);
  torch::nn::Linear fc(kEmbeddingDim, kClasses);
  {
    auto init = initial_dense(config.seed);
    torch::NoGradGuard no_grad;
    fc->weight.copy_(init[0]);
    fc->bias.copy_(init[1]);
  }
  corpc::ddp::DistributedDataParallel dense(fc, group);

  // Every parameter as an RRef for the DistributedOptimizer: the embedding's on the server, the Linear's here.
  auto params = embedding.remote_parameters();
  for (auto& p : dense->parameters()) params.emplace_back(p);
  corpc::DistributedOptimizer<torch::optim::SGD> optimizer(params, torch::optim::SGDOptions(config.lr));

  // Phase timing (Config::phases): `mark(k)` adds the time since the previous mark to phase k.
  std::vector<double> phase_seconds(config.phases ? kPhaseCount : 0, 0.0);
  auto last = std::chrono::steady_clock::now();
  auto mark = [&](std::size_t phase) {
    if (!config.phases) return;
    const auto now = std::chrono::steady_clock::now();
    phase_seconds[phase] += std::chrono::duration<double>(now - last).count();
    last = now;
  };

  const auto t0 = std::chrono::steady_clock::now();
  last = t0;
  for (std::int64_t step = 0; step < config.steps; ++step) {
    auto batch = make_batch(config.seed, trainer, step);
    mark(0);
    {
      corpc::dist_autograd::Context ctx;
      mark(1);
      auto embedded = embedding.forward(batch.indices, batch.offsets);
      mark(2);
      auto out = dense.forward(embedded);
      mark(3);
      auto loss = F::cross_entropy(out, batch.target);
      mark(4);
      ctx.backward({loss}).wait();  // DDP averages the dense gradients in the context as backward reaches them
      mark(5);
      optimizer.step(ctx).wait();
      mark(6);
    }
    mark(7);
    if (config.lockstep) group->barrier()->wait();
    mark(8);
  }
  TrainerResult result;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  result.phase_seconds = std::move(phase_seconds);
  if (config.phases) result.bare_allreduce_seconds = time_bare_allreduce(*group, fc);
  for (auto& p : dense->parameters()) result.dense.push_back(p.detach().clone());
  return result;
}

at::Tensor table_weight(const corpc::RemoteModule<torch::nn::EmbeddingBag>& table) {
  return corpc::rpc_sync<&weight_of>(table.module_rref().owner().rank, table.module_rref());
}

std::vector<at::Tensor> reference(const Config& config) {
  auto embedding = make_embedding_table(config.seed)->weight.detach().clone();
  auto dense = initial_dense(config.seed);
  torch::NoGradGuard outside;  // SGD steps; gradients are computed under an explicit AutoGradMode below
  for (std::int64_t step = 0; step < config.steps; ++step) {
    std::vector<std::vector<at::Tensor>> grads;  // per trainer: embedding, weight, bias
    for (int t = 0; t < kTrainers; ++t) {
      torch::AutoGradMode enable(true);
      auto batch = make_batch(config.seed, t, step);
      std::vector<at::Tensor> leaves{embedding.detach().requires_grad_(true), dense[0].detach().requires_grad_(true),
                                     dense[1].detach().requires_grad_(true)};
      auto e = F::embedding_bag(batch.indices, leaves[0],
                                F::EmbeddingBagFuncOptions().offsets(batch.offsets).mode(torch::kSum));
      auto loss = F::cross_entropy(F::linear(e, leaves[1], leaves[2]), batch.target);
      grads.push_back(torch::autograd::grad({loss}, leaves));
    }
    for (int t = 0; t < kTrainers; ++t) embedding.add_(grads[t][0], -config.lr);
    for (int i = 1; i <= 2; ++i) dense[i - 1].add_((grads[0][i] + grads[1][i]).div_(kTrainers), -config.lr);
  }
  return {embedding, dense[0], dense[1]};
}

}  // namespace systems::hybrid
