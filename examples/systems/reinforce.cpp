#include "reinforce.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <numeric>

namespace systems::rl {

namespace {
at::Generator generator(std::uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }
}  // namespace

PolicyImpl::PolicyImpl(double dropout)
    : affine1_(register_module("affine1", torch::nn::Linear(4, 128))),
      affine2_(register_module("affine2", torch::nn::Linear(128, 2))),
      dropout_(dropout) {}

at::Tensor PolicyImpl::forward(const at::Tensor& state, at::Generator& gen) {
  auto h = affine1_(state);
  if (is_training() && dropout_ > 0) h = h * at::empty_like(h).bernoulli_(1 - dropout_, gen) / (1 - dropout_);
  return at::softmax(affine2_(at::relu(h)), 1);
}

Observer::Observer(int id, Config config)
    : id_(id), env_(config.seed * 1000 + static_cast<std::uint64_t>(id), config.max_steps) {}

corpc::Task<float> Observer::run_episode(corpc::RRef<Agent> agent) {
  auto state = env_.reset();
  float total = 0;
  for (;;) {
    const int action =
        co_await agent.rpc_async<&Agent::select_action>(id_, std::vector<float>(state.begin(), state.end()));
    auto step = env_.step(action);
    co_await agent.rpc_async<&Agent::report_reward>(id_, step.reward);
    total += step.reward;
    state = step.state;
    if (step.done) co_return total;
  }
}

Agent::Agent(const std::vector<int>& observer_ranks, Config config) : config_(config), policy_(nullptr) {
  torch::manual_seed(static_cast<std::int64_t>(config.seed));
  policy_ = Policy(config.dropout);
  optimizer_ = std::make_unique<torch::optim::Adam>(policy_->parameters(), torch::optim::AdamOptions(config.lr));
  for (std::size_t i = 0; i < observer_ranks.size(); ++i) {
    const int id = static_cast<int>(i);
    observers_.push_back(corpc::remote<Observer>(observer_ranks[i], id, config));
    trajectories_.push_back({{}, {}, generator(config.seed * 7777 + i)});
  }
}

int Agent::select_action(int observer, std::vector<float> state) {
  auto& t = trajectories_.at(static_cast<std::size_t>(observer));
  auto probs = policy_->forward(at::tensor(state).unsqueeze(0), t.gen);
  auto action = at::multinomial(probs, 1, false, t.gen);
  std::lock_guard lock(*mutex_);
  t.log_probs.push_back(probs.gather(1, action).log().squeeze());
  return static_cast<int>(action.item<std::int64_t>());
}

void Agent::report_reward(int observer, float reward) {
  std::lock_guard lock(*mutex_);
  trajectories_.at(static_cast<std::size_t>(observer)).rewards.push_back(reward);
}

void Agent::run_episode(const corpc::RRef<Agent>& self) {
  std::vector<corpc::Future<float>> episodes;
  for (auto& ob : observers_) episodes.push_back(ob.rpc_async<&Observer::run_episode>(self));
  corpc::when_all(std::move(episodes)).wait();
}

EpisodeResult Agent::finish_episode() {
  std::vector<at::Tensor> log_probs;
  std::vector<float> rewards;
  float min_reward = std::numeric_limits<float>::max();
  {
    std::lock_guard lock(*mutex_);
    for (auto& t : trajectories_) {
      log_probs.insert(log_probs.end(), t.log_probs.begin(), t.log_probs.end());
      rewards.insert(rewards.end(), t.rewards.begin(), t.rewards.end());
      min_reward = std::min(min_reward, std::accumulate(t.rewards.begin(), t.rewards.end(), 0.0f));
      t.log_probs.clear();
      t.rewards.clear();
    }
  }
  running_reward_ = 0.05f * min_reward + 0.95f * running_reward_;
  // Discounted returns, computed backwards over the concatenated trajectories as the tutorial does, then normalised.
  std::vector<float> returns(rewards.size());
  double r = 0;
  for (std::size_t i = rewards.size(); i-- > 0;) returns[i] = static_cast<float>(r = rewards[i] + config_.gamma * r);
  auto ret = at::tensor(returns);
  ret = (ret - ret.mean()) / (ret.std() + std::numeric_limits<float>::epsilon());
  auto loss = -(at::stack(log_probs) * ret).sum();
  optimizer_->zero_grad();
  loss.backward();
  optimizer_->step();
  return {min_reward, running_reward_};
}

}  // namespace systems::rl
