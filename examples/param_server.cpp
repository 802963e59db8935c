// Parameter servers (PyTorch's parameter-server tutorial and its batch-updating variant): rank 0 ("ps") holds an
// MLP's parameters and starts the loop of every trainer (ranks 1..N) by RPC; each trainer fetches the parameters,
// computes gradients on its own synthetic batches and pushes them.
//
//   ./build/examples/param_server --mode batch --trainers 2 --steps 200      # 3 local processes
//   torchrun --no_python --standalone --nproc_per_node 3 --redirects 1 --tee 1 ./build/examples/param_server --mode async
//
// --mode async: the server applies each gradient as it arrives. --mode batch: one update per round of all trainers'
// gradients, every trainer's call completing when the round is full. Prints steps/s (all trainers together, after
// --warmup steps each) and the trained model's accuracy on held-out data.
#include "systems/param_server.hpp"

#include <chrono>
#include <cstdio>
#include <string>

#include "systems/common.hpp"

using namespace systems::ps;

namespace {

struct Config {
  std::string mode = "async";
  int trainers = 2;
  long steps = 200, warmup = 10;
  double lr = 0.05;
  std::uint64_t seed = 0;
};

template <class Server>
void run_master(const Config& c, corpc::RRef<Server> ps) {
  auto run_all = [&](long steps) {
    std::vector<corpc::Future<TrainerResult>> loops;
    for (int t = 0; t < c.trainers; ++t)
      loops.push_back(corpc::rpc_async<&run_trainer<Server>>(t + 1, ps, t, steps, c.seed));
    return corpc::when_all(std::move(loops)).wait();
  };
  run_all(c.warmup);
  const auto t0 = std::chrono::steady_clock::now();
  auto results = run_all(c.steps);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto final = ps.template rpc_sync<&Server::get_parameters>();
  std::printf(
      "param_server: mode %s, %d trainer(s), %ld steps each: %.1f steps/s, %ld updates, last loss %.4f, "
      "held-out accuracy %.3f\n",
      c.mode.c_str(), c.trainers, c.steps, static_cast<double>(c.steps * c.trainers) / secs,
      static_cast<long>(final.version), static_cast<double>(results[0].last_loss),
      static_cast<double>(accuracy(final.params, held_out_batch(c.seed))));
}

}  // namespace

int main(int argc, char** argv) {
  corpc::bench::Flags flags(argc, argv);
  Config c;
  c.mode = flags.get("mode", c.mode);
  c.trainers = static_cast<int>(flags.get_int("trainers", c.trainers));
  c.steps = flags.get_int("steps", c.steps);
  c.warmup = flags.get_int("warmup", c.warmup);
  c.lr = std::stod(flags.get("lr", "0.05"));
  c.seed = static_cast<std::uint64_t>(flags.get_int("seed", 0));
  if (c.mode != "async" && c.mode != "batch") {
    std::fprintf(stderr, "param_server: --mode async|batch\n");
    return 2;
  }
  return systems::run_program("param_server", c.trainers + 1, [&](int rank) {
    auto options = systems::single_threaded();
    corpc::init_rpc(rank == 0 ? "ps" : "trainer" + std::to_string(rank - 1), rank, c.trainers + 1, options);
    if (rank == 0) {
      if (c.mode == "async") run_master(c, corpc::remote<AsyncParameterServer>("ps", c.seed, c.lr));
      else run_master(c, corpc::remote<BatchUpdatingParameterServer>("ps", c.trainers, c.seed, c.lr));
    }
    corpc::shutdown();
  });
}
