#include "param_server.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cmath>

namespace systems::ps {

namespace {

at::Generator generator(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

at::Tensor uniform(std::vector<std::int64_t> shape, double bound, at::Generator& gen) {
  return at::empty(shape).uniform_(-bound, bound, gen);
}

// The labelling teacher depends on the seed only, so every trainer and the reference label alike.
at::Tensor teacher(std::uint64_t seed) {
  auto gen = generator(seed * 7919 + 17);
  return at::randn({kInputs, kClasses}, gen);
}

Batch make_batch(std::uint64_t seed, std::uint64_t stream, std::int64_t n) {
  auto gen = generator(seed * 1'000'003 + stream);
  auto x = at::randn({n, kInputs}, gen);
  auto y = x.matmul(teacher(seed)).argmax(1);
  return {x, y};
}

// Sum of the gradients in trainer order, divided by the number of trainers: the batch-updating server's average.
std::vector<at::Tensor> mean_in_order(const std::vector<std::vector<at::Tensor>>& grads) {
  std::vector<at::Tensor> out;
  for (std::size_t i = 0; i < grads.front().size(); ++i) {
    auto acc = grads[0][i].clone();
    for (std::size_t t = 1; t < grads.size(); ++t) acc.add_(grads[t][i]);
    out.push_back(acc.div_(static_cast<double>(grads.size())));
  }
  return out;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (auto& t : ts) out.push_back(t.clone());
  return out;
}

}  // namespace

std::vector<at::Tensor> init_parameters(std::uint64_t seed) {
  auto gen = generator(seed);
  const double b1 = 1.0 / std::sqrt(static_cast<double>(kInputs)), b2 = 1.0 / std::sqrt(static_cast<double>(kHidden));
  return {uniform({kHidden, kInputs}, b1, gen), uniform({kHidden}, b1, gen), uniform({kClasses, kHidden}, b2, gen),
          uniform({kClasses}, b2, gen)};
}

at::Tensor mlp_forward(const std::vector<at::Tensor>& p, const at::Tensor& x) {
  return at::linear(at::relu(at::linear(x, p[0], p[1])), p[2], p[3]);
}

Batch synthetic_batch(std::uint64_t seed, int trainer, std::int64_t step, std::int64_t batch) {
  return make_batch(seed, static_cast<std::uint64_t>(trainer) * 1'000'000 + static_cast<std::uint64_t>(step), batch);
}

Batch held_out_batch(std::uint64_t seed, std::int64_t n) { return make_batch(seed, 999'999'999, n); }

std::vector<at::Tensor> gradients(const std::vector<at::Tensor>& params, const Batch& batch, float* loss) {
  std::vector<at::Tensor> leaves;
  for (auto& p : params) leaves.push_back(p.detach().requires_grad_(true));
  auto l = at::cross_entropy_loss(mlp_forward(leaves, batch.x), batch.y);
  if (loss) *loss = l.item<float>();
  return torch::autograd::grad({l}, leaves);
}

void sgd_step(std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads, double lr) {
  at::NoGradGuard no_grad;
  for (std::size_t i = 0; i < params.size(); ++i) params[i].add_(grads[i], -lr);
}

float accuracy(const std::vector<at::Tensor>& params, const Batch& batch) {
  at::NoGradGuard no_grad;
  return mlp_forward(params, batch.x).argmax(1).eq(batch.y).to(at::kFloat).mean().item<float>();
}

AsyncParameterServer::AsyncParameterServer(std::uint64_t seed, double lr) : params_(init_parameters(seed)), lr_(lr) {}

Snapshot AsyncParameterServer::get_parameters() {
  std::lock_guard lock(mutex_);
  return {version_, clone_all(params_)};
}

Snapshot AsyncParameterServer::update_and_fetch(int, std::vector<at::Tensor> grads) {
  std::lock_guard lock(mutex_);
  if (grads.size() != params_.size()) throw corpc::UsageError("update_and_fetch: wrong number of gradients");
  sgd_step(params_, grads, lr_);
  ++version_;
  return {version_, clone_all(params_)};  // a copy: the reply is sent after the lock is released
}

std::int64_t AsyncParameterServer::updates() {
  std::lock_guard lock(mutex_);
  return version_;
}

BatchUpdatingParameterServer::BatchUpdatingParameterServer(int trainers, std::uint64_t seed, double lr)
    : params_(init_parameters(seed)), lr_(lr), round_(static_cast<std::size_t>(trainers)) {
  if (trainers < 1) throw corpc::UsageError("BatchUpdatingParameterServer needs at least one trainer");
}

Snapshot BatchUpdatingParameterServer::get_parameters() {
  std::lock_guard lock(mutex_);
  return {version_, clone_all(params_)};
}

corpc::Future<Snapshot> BatchUpdatingParameterServer::update_and_fetch(int trainer, std::vector<at::Tensor> grads) {
  corpc::Promise<Snapshot> finished;  // set outside the lock: completing it may run the waiting replies inline
  Snapshot result;
  corpc::Future<Snapshot> mine;
  {
    std::lock_guard lock(mutex_);
    if (trainer < 0 || trainer >= static_cast<int>(round_.size()))
      throw corpc::UsageError("update_and_fetch: no trainer " + std::to_string(trainer));
    if (grads.size() != params_.size()) throw corpc::UsageError("update_and_fetch: wrong number of gradients");
    auto& slot = round_[static_cast<std::size_t>(trainer)];
    if (!slot.empty())
      throw corpc::UsageError("update_and_fetch: trainer " + std::to_string(trainer) + " sent twice in one round");
    slot = std::move(grads);
    mine = round_done_.get_future();
    if (++received_ < static_cast<int>(round_.size())) return mine;
    sgd_step(params_, mean_in_order(round_), lr_);
    ++version_;
    for (auto& g : round_) g.clear();
    received_ = 0;
    result = {version_, clone_all(params_)};
    finished = std::exchange(round_done_, corpc::Promise<Snapshot>());
  }
  finished.set_value(std::move(result));
  return mine;
}

std::int64_t BatchUpdatingParameterServer::updates() {
  std::lock_guard lock(mutex_);
  return version_;
}

int BatchUpdatingParameterServer::pending() {
  std::lock_guard lock(mutex_);
  return received_;
}

std::vector<at::Tensor> reference_batch_updating(int trainers, std::int64_t rounds, std::uint64_t seed, double lr) {
  auto params = init_parameters(seed);
  for (std::int64_t r = 0; r < rounds; ++r) {
    std::vector<std::vector<at::Tensor>> grads;
    for (int t = 0; t < trainers; ++t) grads.push_back(gradients(params, synthetic_batch(seed, t, r)));
    sgd_step(params, mean_in_order(grads), lr);
  }
  return params;
}

}  // namespace systems::ps
