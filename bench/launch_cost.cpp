// What one launch_processes call costs, by start method: N ranks that each init_rpc, call their neighbour once and
// shut down, timed from the call to its return, the two methods alternating round by round (docs/launching.md).
//   build/bench/launch_cost [rounds=5] [ranks=3]
// A spawned rank runs this program again from main and loads libtorch again; a forked one starts from a copy of the
// caller. The rank's own work is the same in both.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "corpc/corpc.hpp"

namespace {
int add(int a, int b) { return a + b; }
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const int ranks = argc > 2 ? std::atoi(argv[2]) : 3;
  std::vector<double> spawn_s, fork_s;
  for (int round = 0; round < rounds; ++round) {
    for (const auto method : {corpc::StartMethod::spawn, corpc::StartMethod::fork}) {
      corpc::LaunchOptions options;
      options.start = method;
      options.timeout = std::chrono::seconds(120);
      const auto start = std::chrono::steady_clock::now();
      corpc::launch_processes(
          ranks,
          [ranks](int rank) {
            corpc::init_rpc("worker" + std::to_string(rank));
            if (corpc::rpc_sync<&add>((rank + 1) % ranks, rank, 1) != rank + 1) std::abort();
            corpc::shutdown();
          },
          options);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      (method == corpc::StartMethod::spawn ? spawn_s : fork_s).push_back(s);
    }
  }
  if (!corpc::launching_process()) return 0;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("launch_processes(%d ranks), median of %d rounds: spawn %.2f s, fork %.2f s\n", ranks, rounds,
              median(spawn_s), median(fork_s));
}
