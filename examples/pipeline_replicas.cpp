// Pipeline × data parallelism that trains through lost workers (corpc/ddp/pipeline_replicas.hpp): rank 0 runs the
// quorum coordinator, ranks 1..R·W are the workers of R replicas of a K-stage pipeline (W workers each: K / v, v the
// stages per worker the schedule places). Every step each replica runs the schedule on its own share of the batch,
// and each stage's gradients are averaged over the replicas that take part. With --kill-every K the program SIGKILLs
// one worker after its first action of every K-th step (worker 1 + (step / K) % (R·W)): its replica drops out of
// that step, the other replicas run it again without it, the launcher starts the worker again in place, and its
// replica rejoins once the new process has loaded the state of the worker at the same position of a live replica.
//
//   ./build/examples/pipeline_replicas --replicas 2 --stages 2 --steps 60 --kill-every 20   # 1 + R·W processes
//   ./build/examples/pipeline_replicas --schedule zbv --stages 4 --micro-batches 8
//   corpcrun -n 5 --max-rank-restarts 2 ./build/examples/pipeline_replicas --kill-every 20
//   ./build/examples/pipeline_replicas --steps 40 --checkpoint /tmp/pp --checkpoint-every 20   # step-20, step-40
//   ./build/examples/pipeline_replicas --replicas 1 --steps 60 --checkpoint /tmp/pp --resume  # from step-40 on
//
// Every worker prints a line when the replicas of its committed step change (a replica lost or back, a failed
// attempt, a recovery), the last stage's workers their replica's loss every tenth of the run, and every worker one
// line at the end with a checksum of its stages' parameters: workers at the same position print the same one. A
// replacement that would arrive after the last step still needs a donor, so the workers go on past --steps (slowly)
// until every replica is back. Batches depend only on (step, replica); the model only on --seed. With --checkpoint
// DIR the workers save the committed state every --checkpoint-every steps (DIR/step-N, written while they train on;
// corpc/ddp/replica_checkpoint.hpp), and with --resume they start from the newest one there, with any --replicas and
// --schedule over the same --stages.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <corpc/corpc.hpp>
#include <corpc/ddp/fault_tolerant.hpp>
#include <corpc/ddp/pipeline_replicas.hpp>
#include <corpc/ddp/replica_checkpoint.hpp>
#include <corpc/pipeline/schedule.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../bench/bench_util.hpp"

namespace {

constexpr int kLayers = 8;  // Linear layers of the model, width 64
constexpr int kWidth = 64;
constexpr int kInputs = 16;
constexpr std::int64_t kRows = 32;  // of each replica's share of a batch

struct Config {
  int replicas = 2;
  int stages = 2;
  std::string schedule = "1f1b";
  int micro_batches = 4;
  std::int64_t steps = 100;
  std::int64_t kill_every = 0;  // 0: no faults
  int max_restarts = -1;        // -1: as many as there are kills
  std::uint64_t seed = 0;
  int timeout_s = 300;
  std::string checkpoint;             // a directory: save under it (every checkpoint_every steps), resume from it
  std::int64_t checkpoint_every = 0;  // 0: only at the end
  bool resume = false;
};

// kLayers Linear layers with a Tanh after each but the last (the output, one value), seeded: every worker builds
// the same model and keeps its stages of it.
torch::nn::Sequential make_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(i == 0 ? kInputs : kWidth, i + 1 < kLayers ? kWidth : 1));
    if (i + 1 < kLayers) model->push_back(torch::nn::Tanh());
  }
  return model;
}

// The modules of each of `stages` stages: as even a share of the Linear layers as goes (the first stages take the
// rest), each with the Tanh after it.
std::vector<int> balance(int stages) {
  std::vector<int> out;
  for (int s = 0; s < stages; ++s) out.push_back(2 * (kLayers / stages + (s < kLayers % stages ? 1 : 0)));
  out.back() -= 1;  // the output layer has no Tanh
  return out;
}

at::Tensor mse(const at::Tensor& output, const at::Tensor& target) { return torch::mse_loss(output, target); }

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(0.02).momentum(0.9));
}

// Replica `replica`'s share of step `step`: the same wherever and however often it is asked for (a retried step, a
// restarted worker).
std::pair<at::Tensor, at::Tensor> batch(std::int64_t step, int replica) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step * 1000 + replica));
  auto x = torch::randn({kRows, kInputs}, gen);
  return {x, x.sum(1, true).sin()};
}

corpc::ddp::PipelineReplicaOptions replica_options(const Config& c) {
  corpc::ddp::PipelineReplicaOptions o;
  o.replicas = c.replicas;
  o.balance = balance(c.stages);
  o.schedule = corpc::pipeline::schedule_from_string(c.schedule);
  o.micro_batches = c.micro_batches;
  return o;
}

// The worker (RPC rank) that kills itself during `step`, or -1: every kill_every-th step but step 0.
int victim(const Config& c, int workers, std::int64_t step) {
  if (c.kill_every <= 0 || step == 0 || step >= c.steps || step % c.kill_every != 0) return -1;
  return 1 + static_cast<int>((step / c.kill_every) % workers);
}

std::int64_t kills(const Config& c) { return c.kill_every > 0 && c.steps > 0 ? (c.steps - 1) / c.kill_every : 0; }

std::string list_text(const std::vector<int>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "}";
}

void worker(const Config& c, int rank) {
  auto options = replica_options(c);
  const int R = c.replicas;
  const int workers = corpc::ddp::layout_of(options).world();
  // Armed before a step in which this worker dies: the first action it completes in that step is its last, so the
  // kill comes mid-step (its mates wait for its activations, or it for theirs). Only the rank's first process dies:
  // its replacement has nobody's kill to repeat.
  std::atomic<bool> armed{false};
  options.after_action = [&](std::int64_t step, const corpc::pipeline::Action& done) {
    if (!armed.exchange(false)) return;
    std::printf("worker %d: killing itself after action %d%c%d of step %lld\n", rank, done.stage,
                corpc::pipeline::action_letter(done.kind), done.micro, static_cast<long long>(step));
    std::fflush(stdout);
    ::raise(SIGKILL);
  };
  corpc::ddp::PipelineReplicas pp(make_model(c.seed), &mse, &make_sgd, options);
  // A replacement process does not resume: it recovers the running job's state from a live replica.
  if (c.resume && corpc::rank_restart_count() == 0) {
    const std::string dir = corpc::ddp::latest_replica_checkpoint(c.checkpoint);
    if (dir.empty()) throw corpc::UsageError("--resume: no complete checkpoint under " + c.checkpoint);
    const auto step = pp.load_checkpoint(dir);
    std::printf("worker %d: resumed from %s (step %lld)\n", rank, dir.c_str(), static_cast<long long>(step));
    std::fflush(stdout);
  }
  const bool last_stage = pp.stages().back().stage == c.stages - 1;

  corpc::ddp::ReplicaStepReport report;
  std::vector<int> replicas;  // of the last committed step
  std::int64_t retries = 0, recoveries = 0;
  const std::int64_t every = std::max<std::int64_t>(1, c.steps / 10);
  bool waiting = false;
  // Past --steps only while a replica is missing: its replacement worker recovers from the worker at its position in
  // a live replica, at one of their steps. Those steps are slowed down, so that few are taken while it starts.
  while (pp.committed_steps() < c.steps || report.replicas.size() < static_cast<std::size_t>(R)) {
    if (pp.committed_steps() >= c.steps) {
      if (!waiting) {
        std::printf("worker %d: %lld steps done, training on slowly until every replica is back\n", rank,
                    static_cast<long long>(pp.committed_steps()));
        std::fflush(stdout);
      }
      waiting = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::int64_t running_step = pp.committed_steps();
    if (victim(c, workers, running_step) == rank && corpc::rank_restart_count() == 0) {
      // A replacement recovers from a live replica: with one missing already (its worker still starting), this kill
      // would leave nobody to recover from.
      if (report.replicas.size() == static_cast<std::size_t>(R)) {
        armed = true;
      } else {
        std::printf("worker %d: not killing itself at step %lld, a replica is missing\n", rank,
                    static_cast<long long>(running_step));
        std::fflush(stdout);
      }
    }
    report = pp.step(batch);
    armed = false;
    retries += report.ft.retries;
    if (report.ft.recovered) ++recoveries;
    const auto step = report.ft.quorum.step;
    if (report.replicas != replicas || report.ft.retries > 0 || report.ft.recovered) {
      replicas = report.replicas;
      std::string why;
      if (report.ft.recovered) why += ", recovered its replica's state";
      if (report.ft.retries > 0)
        why += ", after " + std::to_string(report.ft.retries) + " failed attempt(s): " + report.ft.last_error;
      std::printf("worker %d (replica %d, position %d): step %lld, epoch %lld, replicas %s%s\n", rank, pp.replica(),
                  pp.position(), static_cast<long long>(step), static_cast<long long>(report.ft.quorum.epoch),
                  list_text(report.replicas).c_str(), why.c_str());
      std::fflush(stdout);
    }
    if (!c.checkpoint.empty() && c.checkpoint_every > 0 && pp.committed_steps() % c.checkpoint_every == 0)
      pp.save_checkpoint(c.checkpoint);
    if (last_stage && report.loss && step % every == 0) {
      std::printf("worker %d (replica %d): step %lld, loss %.4f\n", rank, pp.replica(), static_cast<long long>(step),
                  *report.loss);
      std::fflush(stdout);
    }
  }
  if (!c.checkpoint.empty()) {
    const std::string dir = pp.save_checkpoint(c.checkpoint);  // the last step (again, if it was just saved)
    pp.wait_checkpoint();
    if (rank == 1) std::printf("worker %d: checkpoint %s\n", rank, dir.c_str());
  }
  double checksum = 0;
  for (const auto& stage : pp.stages())
    for (auto& p : stage.layers->parameters()) checksum += p.detach().to(torch::kDouble).abs().sum().item<double>();
  std::printf(
      "worker %d (replica %d, position %d): done, %lld steps committed, %lld retries, %lld recoveries in this "
      "process, parameter checksum %.12g\n",
      rank, pp.replica(), pp.position(), static_cast<long long>(pp.committed_steps()), static_cast<long long>(retries),
      static_cast<long long>(recoveries), checksum);
  std::fflush(stdout);
}

void run_rank(const Config& c, int rank, int world) {
  at::set_num_threads(1);
  corpc::bench::set_blas_threads(1);
  corpc::RpcOptions options;  // a restarted worker rejoins the running job (CORPC_REJOIN=1, set by the launcher)
  options.worker_thread_init = [] { at::set_num_threads(1); };
  corpc::init_rpc(rank == 0 ? "coordinator" : "worker" + std::to_string(rank), rank, world, options);
  if (rank == 0) {
    const auto layout = corpc::ddp::layout_of(replica_options(c));
    corpc::ddp::QuorumOptions quorum;
    quorum.replica_groups = layout.replica_groups();  // a quorum takes whole replicas
    corpc::ddp::QuorumCoordinator coordinator(quorum);
    corpc::shutdown();  // waits until the workers are done
    const auto s = coordinator.stats();
    std::printf("coordinator: %lld steps committed, %lld attempts voted down, %lld recoveries, last epoch %lld\n",
                static_cast<long long>(s.commits), static_cast<long long>(s.aborted_steps),
                static_cast<long long>(s.recoveries), static_cast<long long>(s.epoch));
    std::fflush(stdout);
    return;
  }
  worker(c, rank);
  corpc::shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  int world = 0;
  try {
    corpc::bench::Flags flags(argc, argv,
                              {"replicas", "stages", "schedule", "micro-batches", "steps", "kill-every", "max-restarts",
                               "seed", "timeout", "checkpoint", "checkpoint-every"},
                              {"help", "resume"});
    if (flags.has("help")) {
      std::printf(
          "usage: pipeline_replicas [--replicas R] [--stages K] [--schedule 1f1b|gpipe|zbh1|interleaved|loopedbfs|"
          "interleavedzb|zbv|dualpipev] [--micro-batches M] [--steps S] [--kill-every K] [--max-restarts N] "
          "[--seed N] [--timeout SECONDS] [--checkpoint DIR [--checkpoint-every N] [--resume]]\n");
      return 0;
    }
    flags.check();
    c.replicas = flags.get_int<int>("replicas", c.replicas);
    c.stages = flags.get_int<int>("stages", c.stages);
    c.schedule = flags.get("schedule", c.schedule);
    c.micro_batches = flags.get_int<int>("micro-batches", c.micro_batches);
    c.steps = flags.get_int<std::int64_t>("steps", c.steps);
    c.kill_every = flags.get_int<std::int64_t>("kill-every", c.kill_every);
    c.max_restarts = flags.get_int<int>("max-restarts", c.max_restarts);
    c.seed = flags.get_int<std::uint64_t>("seed", c.seed);
    c.timeout_s = flags.get_int<int>("timeout", c.timeout_s);
    c.checkpoint = flags.get("checkpoint", "");
    c.checkpoint_every = flags.get_int<std::int64_t>("checkpoint-every", 0);
    c.resume = flags.has("resume");
    if ((c.resume || c.checkpoint_every != 0) && c.checkpoint.empty())
      throw corpc::bench::FlagError("--resume and --checkpoint-every need --checkpoint DIR");
    if (c.checkpoint_every < 0) throw corpc::bench::FlagError("--checkpoint-every must be positive");
    if (c.replicas < 1 || c.stages < 1 || c.stages > kLayers || c.micro_batches < 1 || c.micro_batches > kRows ||
        c.steps < 0 || c.kill_every < 0 || c.timeout_s <= 0)
      throw corpc::bench::FlagError("--replicas, --steps, --kill-every and --timeout must be positive, --stages 1.." +
                                    std::to_string(kLayers) + ", --micro-batches 1.." + std::to_string(kRows));
    if (c.kill_every > 0 && c.replicas < 2)
      throw corpc::bench::FlagError("--kill-every needs at least 2 replicas (a replacement recovers from another)");
    world = 1 + corpc::ddp::layout_of(replica_options(c)).world();  // UsageError for a schedule that does not fit
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr, "pipeline_replicas: %s\n", e.what());
    return 2;
  } catch (const corpc::UsageError& e) {
    std::fprintf(stderr, "pipeline_replicas: %s\n", e.what());
    return 2;
  }
  corpc::LaunchOptions options;
  options.timeout = std::chrono::seconds(c.timeout_s);
  options.max_rank_restarts = c.max_restarts >= 0 ? c.max_restarts : static_cast<int>(kills(c));
  try {
    corpc::launch_processes(
        world, [&](int rank) { run_rank(c, rank, world); }, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_replicas: %s\n", e.what());
    return 1;
  }
  return 0;
}
