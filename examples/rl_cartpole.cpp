// Distributed reinforcement learning (PyTorch's RPC tutorial): an agent on rank 0 and observers on ranks 1..N, each
// stepping its own CartPole (C++ dynamics, no Gym) and asking the agent for actions by RPC on the agent's RRef; the
// agent trains its policy with REINFORCE after every episode, until the running reward passes the threshold.
//
//   ./build/examples/rl_cartpole --observers 2                 # 3 local processes
//   torchrun --no_python --standalone --nproc_per_node 3 --redirects 1 --tee 1 ./build/examples/rl_cartpole
//
// Flags: --observers N, --seed S, --max-steps 500 (per episode), --threshold 475 (CartPole-v1's), --episodes 2000.
#include <chrono>
#include <cstdio>
#include <string>

#include "systems/common.hpp"
#include "systems/reinforce.hpp"

using namespace systems::rl;

int main(int argc, char** argv) {
  corpc::bench::Flags flags(argc, argv);
  const int observers = static_cast<int>(flags.get_int("observers", 2));
  const long episodes = flags.get_int("episodes", 2000);
  const double threshold = std::stod(flags.get("threshold", "475"));
  Config config;
  config.seed = static_cast<std::uint64_t>(flags.get_int("seed", 1));
  config.max_steps = static_cast<int>(flags.get_int("max-steps", 500));
  return systems::run_program("rl_cartpole", observers + 1, [&](int rank) {
    corpc::init_rpc(rank == 0 ? "agent" : "observer" + std::to_string(rank), rank, observers + 1,
                    systems::single_threaded());
    if (rank == 0) {
      std::vector<int> ranks;
      for (int r = 1; r <= observers; ++r) ranks.push_back(r);
      corpc::RRef<Agent> agent(Agent(ranks, config));
      const auto t0 = std::chrono::steady_clock::now();
      for (long episode = 1; episode <= episodes; ++episode) {
        agent.local_value().run_episode(agent);
        auto result = agent.local_value().finish_episode();
        if (episode % 10 == 0 || result.running_reward > threshold)
          std::printf("episode %ld: last reward %.0f, running reward %.2f\n", episode, result.min_reward,
                      result.running_reward);
        if (result.running_reward > threshold) {
          std::printf("solved after %ld episodes, %.1f s: running reward %.2f > %.0f\n", episode,
                      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                      result.running_reward, threshold);
          break;
        }
      }
    }
    corpc::shutdown();
  });
}
