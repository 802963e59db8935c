// Fault-tolerant data parallelism (corpc/ddp/fault_tolerant.hpp): rank 0 runs the quorum coordinator, ranks 1..N
// train an MLP through FaultTolerantDdp. With --kill-every K the program SIGKILLs one trainer at the start of every
// K-th step (trainer 1 + (step / K) % N); the launcher starts it again in place, the new process rejoins RPC, loads a
// live trainer's state and trains on, while the others lose only the step in progress (retried without the dead one).
//
//   ./build/examples/ddp_fault_tolerant --trainers 3 --steps 60 --kill-every 20       # N + 1 local processes
//   corpcrun -n 4 --max-rank-restarts 2 ./build/examples/ddp_fault_tolerant --kill-every 20
//
// Every trainer prints a line when its quorum's epoch changes (new members, or a failed attempt) and one at the end
// with a checksum of its parameters: the trainers of the last quorum print the same one. A replacement that would
// arrive after the last step still needs a donor, so the trainers go on past --steps (slowly) until every trainer is
// back in the quorum. Batches depend only on (step, rank); every trainer starts from torch::manual_seed(0).
//
// Under a launcher that does not start a lost rank again (srun, mpirun), pass --no-replacements: the survivors then
// train to --steps without the lost trainer and end (srun -n 4 ./ddp_fault_tolerant --kill-every 20 --no-replacements;
// srun's own status is then the killed task's, the survivors' 0).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <corpc/corpc.hpp>
#include <corpc/ddp/fault_tolerant.hpp>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>

#include "../bench/bench_util.hpp"

namespace {

struct Config {
  int trainers = 3;
  std::int64_t steps = 100;
  std::int64_t kill_every = 0;  // 0: no faults
  int max_rank_restarts = -1;   // -1: as many as there are kills
  int timeout_s = 300;
  bool no_replacements = false;  // a lost trainer is not started again: the survivors end at --steps without it
  int pause_ms = 0;              // a pause in every step: time to watch the job, or for a launcher to act
};

// The trainer (RPC rank) that kills itself at the start of `step`, or -1: every kill_every-th step but step 0.
int victim(const Config& c, std::int64_t step) {
  if (c.kill_every <= 0 || step == 0 || step >= c.steps || step % c.kill_every != 0) return -1;
  return 1 + static_cast<int>((step / c.kill_every) % c.trainers);
}

std::int64_t kills(const Config& c) { return c.kill_every > 0 && c.steps > 0 ? (c.steps - 1) / c.kill_every : 0; }

// This trainer's share of step `step`: 32 rows of a regression, the same whoever computes it.
std::pair<torch::Tensor, torch::Tensor> batch(std::int64_t step, int rank) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step * 1000 + rank));
  auto x = torch::randn({32, 16}, gen);
  return {x, x.sum(1, true).sin()};
}

std::string members_text(const std::vector<int>& members) {
  std::string s = "{";
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(members[i]);
  }
  return s + "}";
}

void trainer(const Config& c, int rank) {
  torch::manual_seed(0);  // the same initial weights on every trainer (a replacement loads a donor's anyway)
  auto net = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                   torch::nn::ReLU(), torch::nn::Linear(64, 1));
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.02).momentum(0.9));
  corpc::ddp::FaultTolerantDdp<torch::nn::Sequential> ft(net, opt);

  std::int64_t first_step = -1;  // the first step this process runs: a replacement never kills itself at it
  std::int64_t epoch = -1;
  int last_members = 0;
  float loss_value = 0;
  bool waiting = false;
  // Past --steps only while a trainer is missing: its replacement joins at one of the members' steps and recovers
  // from one of them. Those steps are slowed down, so that few are taken while it starts.
  while (ft.committed_steps() < c.steps || (!c.no_replacements && last_members < c.trainers)) {
    if (ft.committed_steps() >= c.steps) {
      if (!waiting) {
        std::printf("trainer %d: %lld steps done, training on slowly until every trainer is back\n", rank,
                    static_cast<long long>(ft.committed_steps()));
        std::fflush(stdout);
      }
      waiting = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const auto report = ft.step([&](const corpc::ddp::Quorum& q) {
      if (first_step < 0) first_step = q.step;
      // The first process of this rank to reach a kill step dies there, if another member can be its donor.
      if (victim(c, q.step) == rank && q.step > first_step && q.member_count() > 1) {
        std::printf("trainer %d: killing itself at the start of step %lld\n", rank, static_cast<long long>(q.step));
        std::fflush(stdout);
        ::raise(SIGKILL);
      }
      if (c.pause_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(c.pause_ms));
      auto [x, y] = batch(q.step, rank);
      auto loss = torch::mse_loss(ft.forward(x), y);
      loss.backward();
      loss_value = loss.item<float>();
    });
    const auto& q = report.quorum;
    last_members = q.member_count();
    if (q.epoch != epoch) {
      epoch = q.epoch;
      std::string why;
      if (report.recovered) why += ", recovered from trainer " + std::to_string(q.recover_from);
      if (report.retries > 0)
        why += ", after " + std::to_string(report.retries) + " failed attempt(s): " + report.last_error;
      std::printf("trainer %d: step %lld, epoch %lld, members %s, loss %.4f%s\n", rank, static_cast<long long>(q.step),
                  static_cast<long long>(q.epoch), members_text(q.members).c_str(), loss_value, why.c_str());
      std::fflush(stdout);
    }
  }
  double checksum = 0;
  for (auto& p : net->parameters()) checksum += p.detach().to(torch::kDouble).abs().sum().item<double>();
  std::printf("trainer %d: done, %lld steps committed, loss %.4f, parameter checksum %.12g\n", rank,
              static_cast<long long>(ft.committed_steps()), loss_value, checksum);
  std::fflush(stdout);
}

void run_rank(const Config& c, int rank) {
  at::set_num_threads(1);
  corpc::bench::set_blas_threads(1);
  corpc::RpcOptions options;  // a restarted rank rejoins the running job (CORPC_REJOIN=1, set by the launcher)
  options.worker_thread_init = [] { at::set_num_threads(1); };
  // No replacement comes: the job ends well when the survivors finish, so a lost trainer does not fail shutdown().
  options.lost_rank_fails_shutdown = !c.no_replacements;
  corpc::init_rpc(rank == 0 ? "coordinator" : "trainer" + std::to_string(rank), rank, c.trainers + 1, options);
  if (rank == 0) {
    corpc::ddp::QuorumCoordinator coordinator;
    corpc::shutdown();  // waits until the trainers are done
    const auto s = coordinator.stats();
    std::printf("coordinator: %lld steps committed, %lld attempts voted down, %lld recoveries, last epoch %lld\n",
                static_cast<long long>(s.commits), static_cast<long long>(s.aborted_steps),
                static_cast<long long>(s.recoveries), static_cast<long long>(s.epoch));
    return;
  }
  trainer(c, rank);
  corpc::shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    corpc::bench::Flags flags(argc, argv,
                              {"trainers", "steps", "kill-every", "max-rank-restarts", "timeout", "pause-ms"},
                              {"help", "no-replacements"});
    if (flags.has("help")) {
      std::printf(
          "usage: ddp_fault_tolerant [--trainers N] [--steps S] [--kill-every K] [--max-rank-restarts R] "
          "[--timeout SECONDS] [--no-replacements] [--pause-ms MS]\n");
      return 0;
    }
    flags.check();
    c.trainers = flags.get_int<int>("trainers", c.trainers);
    c.steps = flags.get_int<std::int64_t>("steps", c.steps);
    c.kill_every = flags.get_int<std::int64_t>("kill-every", c.kill_every);
    c.max_rank_restarts = flags.get_int<int>("max-rank-restarts", c.max_rank_restarts);
    c.timeout_s = flags.get_int<int>("timeout", c.timeout_s);
    c.no_replacements = flags.has("no-replacements");
    c.pause_ms = flags.get_int<int>("pause-ms", c.pause_ms);
    if (c.trainers < 1 || c.steps < 0 || c.kill_every < 0 || c.timeout_s <= 0 || c.pause_ms < 0)
      throw corpc::bench::FlagError("--trainers, --steps, --kill-every, --timeout and --pause-ms must be positive");
    if (c.kill_every > 0 && c.trainers < 2)
      throw corpc::bench::FlagError("--kill-every needs at least 2 trainers (a replacement recovers from another)");
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr, "ddp_fault_tolerant: %s\n", e.what());
    return 2;
  }
  corpc::LaunchOptions options;
  options.timeout = std::chrono::seconds(c.timeout_s);
  options.max_rank_restarts =
      c.max_rank_restarts >= 0 ? c.max_rank_restarts : (c.no_replacements ? 0 : static_cast<int>(kills(c)));
  try {
    corpc::launch_processes(
        c.trainers + 1, [&](int rank) { run_rank(c, rank); }, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_fault_tolerant: %s\n", e.what());
    return 1;
  }
  return 0;
}
