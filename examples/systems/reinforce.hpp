// Distributed reinforcement learning from PyTorch's RPC tutorial, on corpc: one agent (rank 0) owns the policy;
// observers (ranks 1..N) each step their own CartPole and ask the agent for every action by RPC on the agent's RRef.
// After each episode the agent trains the policy with REINFORCE on all observers' trajectories.
//
//   corpc::RRef<Agent> agent(Agent(observer_ranks, config));      // on rank 0
//   for (...) { agent.local_value().run_episode(agent); agent.local_value().finish_episode(); }
//
// Reproducible: each observer's environment and each observer's action sampling (and the policy's dropout masks for
// it) draw from their own generators, and the episode's trajectories are concatenated in observer order, so the
// interleaving of the observers' calls does not change what is learnt.
#pragma once

#include <corpc/corpc.hpp>
#include <corpc/rref/rref.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "cartpole.hpp"

namespace systems::rl {

struct Config {
  std::uint64_t seed = 1;
  int max_steps = 500;  // per observer and episode (CartPole-v1's limit)
  double gamma = 0.99;
  double lr = 1e-2;
  double dropout = 0.6;
  CORPC_FIELDS(seed, max_steps, gamma, lr, dropout)
};

// Linear(4, 128) -> Dropout(0.6) -> ReLU -> Linear(128, 2) -> softmax, as in the tutorial; the dropout mask comes from
// the caller's generator.
class PolicyImpl : public torch::nn::Module {
 public:
  explicit PolicyImpl(double dropout);
  at::Tensor forward(const at::Tensor& state, at::Generator& gen);

 private:
  torch::nn::Linear affine1_{nullptr}, affine2_{nullptr};
  double dropout_;
};
TORCH_MODULE(Policy);

class Agent;

class Observer {
 public:
  Observer(int id, Config config);
  // Runs one episode, asking `agent` for each action and reporting each reward. Returns the episode's reward.
  corpc::Task<float> run_episode(corpc::RRef<Agent> agent);

 private:
  int id_;
  CartPole env_;
};

struct EpisodeResult {
  float min_reward = 0;      // the worst observer's episode reward (what the tutorial tracks)
  float running_reward = 0;  // exponential average of min_reward, weight 0.05
};

class Agent {
 public:
  // Creates one Observer on each of `observer_ranks`.
  Agent(const std::vector<int>& observer_ranks, Config config);

  // Called by observers through the agent's RRef.
  int select_action(int observer, std::vector<float> state);
  void report_reward(int observer, float reward);

  // One episode on every observer at once; completes when all have finished. `self` is this agent's RRef.
  void run_episode(const corpc::RRef<Agent>& self);
  // REINFORCE on the episode's trajectories (observer order), one Adam step; clears them.
  EpisodeResult finish_episode();
  float running_reward() const { return running_reward_; }

 private:
  struct Trajectory {
    std::vector<at::Tensor> log_probs;
    std::vector<float> rewards;
    at::Generator gen;
  };
  Config config_;
  Policy policy_;
  std::unique_ptr<torch::optim::Adam> optimizer_;
  std::vector<corpc::RRef<Observer>> observers_;
  std::vector<Trajectory> trajectories_;  // by observer id; each observer touches only its own
  std::unique_ptr<std::mutex> mutex_ = std::make_unique<std::mutex>();  // the policy's graph is built concurrently
  float running_reward_ = 0;
};

}  // namespace systems::rl
