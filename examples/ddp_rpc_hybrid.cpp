// DDP + RPC (PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"): 4 processes. Ranks 0 and
// 1 are trainers, each with a DDP-wrapped Linear; rank 2, the master, creates an EmbeddingBag on rank 3, the
// parameter server, and starts both trainers' loops by RPC, handing them the remote module. Each step: embedding
// lookup on the server, the Linear locally, distributed autograd backward (the dense gradients averaged across the
// trainers, the embedding's sent to the server), one DistributedOptimizer step over all parameters.
//
//   ./build/examples/ddp_rpc_hybrid --steps 100                # 4 local processes
//   torchrun --no_python --standalone --nproc_per_node 4 --redirects 1 --tee 1 ./build/examples/ddp_rpc_hybrid
//
// Prints steps/s (synchronised steps of both trainers) and checks that both trainers end with the same dense layer.
// --phases adds a table: each phase's mean µs per step and its share of the step, on each trainer (the phases:
// systems::hybrid::kPhases), and the time of one allreduce of the dense gradients alone on the trainers' group.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "systems/common.hpp"
#include "systems/hybrid.hpp"

using namespace systems::hybrid;

namespace {

// One row per phase, then the rest of the loop (what no phase covers) and the whole step: mean µs per step and share
// of the trainer's loop, for each trainer.
void print_phases(const std::vector<TrainerResult>& results, std::int64_t steps) {
  std::printf("| phase |");
  for (std::size_t t = 0; t < results.size(); ++t) std::printf(" trainer %zu µs/step | share |", t);
  std::printf("\n|---|");
  for (std::size_t t = 0; t < results.size(); ++t) std::printf("---:|---:|");
  std::printf("\n");
  auto row = [&](const char* name, auto seconds_of) {
    std::printf("| %s |", name);
    for (const auto& r : results) {
      const double s = seconds_of(r);
      std::printf(" %.1f | %.1f%% |", s * 1e6 / static_cast<double>(steps), 100.0 * s / r.seconds);
    }
    std::printf("\n");
  };
  for (std::size_t k = 0; k < kPhaseCount; ++k)
    row(kPhases[k], [k](const TrainerResult& r) { return r.phase_seconds[k]; });
  row("other", [](const TrainerResult& r) {
    double rest = r.seconds;
    for (double s : r.phase_seconds) rest -= s;
    return rest;
  });
  row("step", [](const TrainerResult& r) { return r.seconds; });
  std::printf("c10d allreduce of the dense gradients alone (Gloo, after training), µs per call:");
  for (std::size_t t = 0; t < results.size(); ++t)
    std::printf(" trainer %zu %.1f%s", t, results[t].bare_allreduce_seconds * 1e6, t + 1 < results.size() ? "," : "\n");
}

}  // namespace

int main(int argc, char** argv) {
  corpc::bench::Flags flags(argc, argv);
  Config config;
  config.steps = flags.get_int("steps", 100);
  config.seed = static_cast<std::uint64_t>(flags.get_int("seed", 0));
  config.lockstep = flags.has("lockstep");
  config.phases = flags.has("phases");
  const long warmup = flags.get_int("warmup", 5);
  return systems::run_program("ddp_rpc_hybrid", 4, [&](int rank) {
    const std::string name = rank < 2 ? "trainer" + std::to_string(rank) : rank == 2 ? "master" : "ps";
    corpc::init_rpc(name, rank, 4, systems::single_threaded());
    if (rank == 2) {
      corpc::RemoteModule<torch::nn::EmbeddingBag> table(corpc::remote<&make_embedding_table>("ps", config.seed));
      auto run = [&](Config c) {
        std::vector<corpc::Future<TrainerResult>> loops;
        for (int t = 0; t < kTrainers; ++t) loops.push_back(corpc::rpc_async<&run_trainer>(t, table, t, c));
        return corpc::when_all(std::move(loops)).wait();
      };
      Config first = config;
      first.steps = warmup;  // also joins the trainers' process group
      run(first);
      auto results = run(config);
      bool same = true;
      for (std::size_t i = 0; i < results[0].dense.size(); ++i)
        same = same && at::equal(results[0].dense[i], results[1].dense[i]);
      std::printf("ddp_rpc_hybrid: %ld steps: %.1f steps/s; trainers' dense parameters %s\n",
                  static_cast<long>(config.steps),
                  static_cast<double>(config.steps) / std::max(results[0].seconds, results[1].seconds),
                  same ? "identical" : "DIFFER");
      if (config.phases) print_phases(results, config.steps);
      if (!same) throw std::runtime_error("the trainers' dense parameters differ");
    }
    corpc::shutdown();
  });
}
