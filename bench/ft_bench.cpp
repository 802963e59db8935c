// Goodput under faults (issue 29): fault-tolerant DDP (corpc/ddp/fault_tolerant.hpp) against restarting the whole
// group from its last checkpoint (corpc/ddp/elastic.hpp, torchelastic's way), on the same job:
//
//   ft_bench [--steps 500] [--kill-every 50] [--kill-offset K/2] [--checkpoint-every 50] [--trainers 3]
//            [--repeats 1] [--mode ft|restart|both] [--batch 64] [--timeout 600] [--verbose] [--keep]
//
// The job: --trainers ranks train an MLP 256-512-512-10 (torch::manual_seed(0) on every rank) with SGD + momentum on
// batches of --batch rows that depend only on (step, trainer), one intra-op thread per process. One trainer SIGKILLs
// itself at the start of steps offset, offset + K, offset + 2K, ... below --steps (the i-th kill: trainer i % N),
// in the first process of that rank to reach the step.
//   ft:      N trainers and a quorum coordinator (rank 0) under launch_processes with max_rank_restarts: the killed
//            rank is started again in place, rejoins and recovers from a live trainer; the others retry the step in
//            progress without it. A trainer whose death would leave no live trainer (the others' replacements are
//            still starting) skips its kill. So that a late replacement still finds a donor, the trainers go on past
//            --steps until all N are back (those steps count for nothing here: the job ends at its last step's
//            commit).
//   restart: N ranks of plain DistributedDataParallel under launch_with_restarts (the launcher kills the rest of the
//            group as soon as one rank dies, as torchelastic's agent does: grace 0), a checkpoint every
//            --checkpoint-every steps (rank 0 writes, all wait); every attempt loads the last checkpoint and redoes
//            the steps after it. After an ft run it makes that run's kills (same ranks, same steps, skipped ones
//            left out), so that both lose the same.
// The default offset K/2 puts each kill halfway between two checkpoints (the mean loss of a fault at a random time);
// --kill-offset 0 kills right after a checkpoint, the restarting group's best case.
//
// Every rank appends "event step t_ns" lines (std::chrono::steady_clock, one clock for the whole host) to a file of
// its process in a temporary directory; after each launch returns, this process reads them and prints one row per
// run: steps/s before the first kill; per kill (means): time to the next committed step among the survivors (the
// restarted group), to the killed rank's first commit in its new process, to the killed step's commit; steps redone;
// the job's wall time (from the launch to its last step's commit) and goodput (--steps / wall). Then the ratio of
// goodputs, ft / restart, per repeat (runs alternate ft, restart, ft, restart, ...). Numbers only, no thresholds.
// The launcher's warnings (each restart) go to stderr; the ranks log errors only (CORPC_LOG=error unless set).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <corpc/corpc.hpp>
#include <corpc/ddp/checkpoint.hpp>
#include <corpc/ddp/ddp.hpp>
#include <corpc/ddp/elastic.hpp>
#include <corpc/ddp/fault_tolerant.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "ft_events.hpp"

namespace {

namespace fs = std::filesystem;
using corpc::bench::cell;
using corpc::bench::Event;
using corpc::bench::EventLog;
using corpc::bench::Kill;  // Kill::worker: the trainer (0-based)
using corpc::bench::now_ns;

struct Config {
  std::int64_t steps = 500;
  std::int64_t kill_every = 50;   // 0: no kills
  std::int64_t kill_offset = -1;  // -1: kill_every / 2
  std::int64_t checkpoint_every = 50;
  int trainers = 3;
  int repeats = 1;
  std::string mode = "both";
  std::int64_t batch = 64;
  int timeout_s = 600;
  bool verbose = false;
  bool keep = false;
};

// The steps at whose start a trainer dies, in order; the i-th kill is trainer i % N's (0-based trainer index).
std::vector<std::int64_t> kill_steps(const Config& c) {
  return corpc::bench::kill_steps(c.steps, c.kill_every, c.kill_offset);
}

// The index of the kill at `step`, or -1.
int kill_index(const Config& c, std::int64_t step) {
  const auto ks = kill_steps(c);
  const auto it = std::find(ks.begin(), ks.end(), step);
  return it == ks.end() ? -1 : static_cast<int>(it - ks.begin());
}

// The trainer (0-based) that dies at the start of `step`, or -1.
int victim(const Config& c, std::int64_t step) {
  const int k = kill_index(c, step);
  return k < 0 ? -1 : k % c.trainers;
}

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(256, 512), torch::nn::ReLU(), torch::nn::Linear(512, 512),
                               torch::nn::ReLU(), torch::nn::Linear(512, 10));
}

torch::optim::SGDOptions sgd() { return torch::optim::SGDOptions(0.01).momentum(0.9); }

// Trainer `trainer`'s share of step `step`: the same in both modes, whichever process computes it.
std::pair<torch::Tensor, torch::Tensor> batch(const Config& c, std::int64_t step, int trainer) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step * 1000 + trainer));
  return {torch::randn({c.batch, 256}, gen), torch::randint(0, 10, {c.batch}, gen)};
}

void single_threaded() {
  at::set_num_threads(1);
  corpc::bench::set_blas_threads(1);
}

// ---- ft: rank 0 coordinates, ranks 1..N train ----

void ft_rank(const Config& c, const std::string& dir, int rank) {
  EventLog log(dir, rank, "ft_bench");
  log("start", -1);
  single_threaded();
  corpc::RpcOptions options;  // a restarted rank rejoins (CORPC_REJOIN=1)
  options.worker_thread_init = [] { at::set_num_threads(1); };
  corpc::init_rpc(rank == 0 ? "coordinator" : "trainer" + std::to_string(rank), rank, c.trainers + 1, options);
  if (rank == 0) {
    corpc::ddp::QuorumCoordinator coordinator;
    log("ready", 0);
    corpc::shutdown();
    corpc::bench::log_stats(log, coordinator.stats());
    return;
  }
  const int trainer = rank - 1;
  auto net = make_model();
  torch::optim::SGD opt(net->parameters(), sgd());
  corpc::ddp::FaultTolerantDdp<torch::nn::Sequential> ft(net, opt);
  log("ready", ft.committed_steps());
  std::int64_t first_step = -1;  // this process's first step: it never dies there (it replaces the one that did)
  int last_members = 0;
  while (ft.committed_steps() < c.steps || last_members < c.trainers) {
    const auto report = ft.step([&](const corpc::ddp::Quorum& q) {
      if (first_step < 0) first_step = q.step;
      if (victim(c, q.step) == trainer && q.step > first_step && q.member_count() > 1) {
        log("kill", q.step);
        ::raise(SIGKILL);
      }
      auto [x, y] = batch(c, q.step, trainer);
      torch::cross_entropy_loss(ft.forward(x), y).backward();
    });
    if (report.recovered) log("recovered", report.quorum.step);
    for (int i = 0; i < report.retries; ++i) log("retry", report.quorum.step);
    log("commit", report.quorum.step);
    last_members = report.quorum.member_count();
  }
  log("done", ft.committed_steps());
  corpc::shutdown();
}

// ---- restart: N ranks of plain DDP, the whole group restarted from the last checkpoint ----

std::string checkpoint_path(const std::string& dir, std::int64_t step) {
  return dir + "/ckpt-" + std::to_string(step) + ".pt";
}

// The step of the last checkpoint in `dir` (0 if none). A file there is complete: rank 0 writes it while every other
// rank waits in save_checkpoint's barrier, and ranks die only at the start of a step.
std::int64_t last_checkpoint(const std::string& dir) {
  std::int64_t last = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("ckpt-", 0) == 0 && name.size() > 8 && name.substr(name.size() - 3) == ".pt")
      last = std::max<std::int64_t>(last, std::stoll(name.substr(5, name.size() - 8)));
  }
  return last;
}

// The kills a restart run makes: those of the ft run before it in the same repeat if there was one (its "kills"
// file: ft skips a kill whose victim has no live peer to recover from, so both lose the same ranks at the same
// steps), else the plan.
std::vector<Kill> restart_kills(const Config& c, const std::string& dir) {
  if (auto made = corpc::bench::read_kills(dir + "/kills")) return *made;
  std::vector<Kill> kills;
  for (std::int64_t s : kill_steps(c)) kills.push_back({s, victim(c, s)});
  return kills;
}

void restart_rank(const Config& c, const std::string& dir, int rank, int restart) {
  EventLog log(dir, rank, "ft_bench");
  log("start", restart);
  const auto kills = restart_kills(c, dir);
  single_threaded();
  corpc::ddp::ProcessGroupOptions pg;
  pg.timeout = std::chrono::seconds(10);  // FaultTolerantOptions::collective_timeout's default
  auto group = corpc::ddp::init_process_group(pg);
  auto net = make_model();
  torch::optim::SGD opt(net->parameters(), sgd());
  std::int64_t step = last_checkpoint(dir);
  if (step > 0) corpc::ddp::load_checkpoint(*net, &opt, checkpoint_path(dir, step));
  corpc::ddp::DistributedDataParallel<torch::nn::Sequential> ddp(net, group);
  log("ready", step);
  for (; step < c.steps; ++step) {
    // The i-th kill happens in the i-th attempt: the attempts after it redo its step without dying.
    if (restart < static_cast<int>(kills.size()) && kills[restart].step == step && kills[restart].worker == rank) {
      log("kill", step);
      ::raise(SIGKILL);
    }
    opt.zero_grad();
    auto [x, y] = batch(c, step, rank);
    torch::cross_entropy_loss(ddp.forward(x), y).backward();
    opt.step();
    log("commit", step);
    if (c.checkpoint_every > 0 && (step + 1) % c.checkpoint_every == 0 && step + 1 < c.steps) {
      corpc::ddp::save_checkpoint(*net, &opt, checkpoint_path(dir, step + 1), *group);
      log("checkpoint", step + 1);
    }
  }
  log("done", step);
}

// ---- reading the timestamps ----

struct Result {
  std::string mode;
  int repeat = 0;
  bool failed = false;
  std::string error;
  double pre_kill_rate = 0;  // steps/s
  int kills = 0;
  double to_next_commit_ms = -1;  // means over kills; -1: none
  double to_replacement_ms = -1;
  double to_killed_step_ms = -1;
  double to_ready_ms = -1;  // kill → the restarted process ready to train (model built, state loaded)
  std::int64_t redone = 0;
  double wall_s = 0;    // launch → the job's last step committed
  double launch_s = 0;  // launch → launch returned
  double goodput = 0;
  int restarts = 0;              // restart mode: group restarts
  std::int64_t extra_steps = 0;  // ft: steps past --steps while waiting for a replacement
  std::int64_t retries = 0, recoveries = 0;
  std::string coordinator;      // ft: the coordinator's counts
  std::vector<Kill> kill_list;  // the kills that happened
};

Result analyse(const Config& c, const std::string& mode, const std::string& dir, std::int64_t t0, std::int64_t t1) {
  Result r;
  r.launch_s = static_cast<double>(t1 - t0) / 1e9;
  const auto run = corpc::bench::read_events(dir);
  const auto tally = corpc::bench::tally(run, c.steps);
  r.retries = tally.retries;
  r.recoveries = tally.recoveries;
  r.coordinator = tally.coordinator;
  r.kills = static_cast<int>(tally.kills.size());
  // Trainer t is RPC rank t + 1 under ft (rank 0 coordinates), DDP rank t under restart.
  for (const Event* k : tally.kills) r.kill_list.push_back({k->step, mode == "ft" ? k->rank - 1 : k->rank});
  r.extra_steps = tally.extra_steps;
  const auto end = corpc::bench::job_end(run, tally, c.steps);
  if (!end) {
    r.failed = true;
    r.error = "step " + std::to_string(c.steps - 1) + " was never committed";
    return r;
  }
  r.wall_s = static_cast<double>(*end - t0) / 1e9;
  r.goodput = static_cast<double>(c.steps) / r.wall_s;
  // Steps/s before the first kill, from the first commit of each step (after a few warm-up steps).
  if (const auto span = corpc::bench::steady_span(tally, c.steps, 5))
    r.pre_kill_rate = static_cast<double>(span->steps) / (static_cast<double>(span->ns) / 1e9);

  std::vector<double> next, replacement, killed, ready;
  for (const Event* k : tally.kills) {
    using corpc::bench::first_after;
    // The survivors' next step (a straggler's commit of the step before the kill does not count), or the restarted
    // group's first.
    const Event* t_next = first_after(
        run, *k, [&](const Event& e, bool fresh) { return e.name == "commit" && (e.step >= k->step || fresh); });
    const Event* t_replacement =
        first_after(run, *k, [&](const Event& e, bool) { return e.name == "commit" && e.rank == k->rank; });
    const Event* t_killed =
        first_after(run, *k, [&](const Event& e, bool) { return e.name == "commit" && e.step == k->step; });
    const Event* t_ready = first_after(
        run, *k, [&](const Event& e, bool fresh) { return e.name == "ready" && e.rank == k->rank && fresh; });
    const std::int64_t next_step = t_next ? t_next->step : k->step;
    auto ms = [&](const Event* e, std::vector<double>& into) {
      if (e) into.push_back(corpc::bench::ms_since(*k, *e));
    };
    ms(t_next, next);
    ms(t_replacement, replacement);
    ms(t_killed, killed);
    ms(t_ready, ready);
    r.redone += std::max<std::int64_t>(0, k->step - next_step);
    if (c.verbose) {
      auto text = [&](const Event* e) { return corpc::bench::ms_since_text(*k, e); };
      std::printf(
          "#   kill of rank %d at step %lld: next commit (step %lld) %s, rank's new process ready %s, "
          "its first commit %s, step %lld committed %s\n",
          k->rank, static_cast<long long>(k->step), static_cast<long long>(next_step), text(t_next).c_str(),
          text(t_ready).c_str(), text(t_replacement).c_str(), static_cast<long long>(k->step), text(t_killed).c_str());
    }
  }
  r.to_next_commit_ms = corpc::bench::mean_or_none(next);
  r.to_replacement_ms = corpc::bench::mean_or_none(replacement);
  r.to_killed_step_ms = corpc::bench::mean_or_none(killed);
  r.to_ready_ms = corpc::bench::mean_or_none(ready);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    corpc::bench::Flags flags(
        argc, argv,
        {"steps", "kill-every", "kill-offset", "checkpoint-every", "trainers", "repeats", "mode", "batch", "timeout"},
        {"verbose", "keep", "help"});
    if (flags.has("help")) {
      std::printf(
          "usage: ft_bench [--steps 500] [--kill-every 50] [--kill-offset K/2] [--checkpoint-every 50] "
          "[--trainers 3] [--repeats 1] [--mode ft|restart|both] [--batch 64] [--timeout 600] [--verbose] [--keep]\n");
      return 0;
    }
    flags.check();
    c.steps = flags.get_int<std::int64_t>("steps", c.steps);
    c.kill_every = flags.get_int<std::int64_t>("kill-every", c.kill_every);
    c.kill_offset = flags.get_int<std::int64_t>("kill-offset", c.kill_every / 2);
    c.checkpoint_every = flags.get_int<std::int64_t>("checkpoint-every", c.checkpoint_every);
    c.trainers = flags.get_int<int>("trainers", c.trainers);
    c.repeats = flags.get_int<int>("repeats", c.repeats);
    c.mode = flags.get("mode", c.mode);
    c.batch = flags.get_int<std::int64_t>("batch", c.batch);
    c.timeout_s = flags.get_int<int>("timeout", c.timeout_s);
    c.verbose = flags.has("verbose");
    c.keep = flags.has("keep");
    if (c.mode != "ft" && c.mode != "restart" && c.mode != "both")
      throw corpc::bench::FlagError("--mode ft|restart|both");
    if (c.steps < 2 || c.trainers < 1 || c.repeats < 1 || c.batch < 1 || c.timeout_s < 1 || c.kill_every < 0 ||
        c.kill_offset < 0 || c.checkpoint_every < 0)
      throw corpc::bench::FlagError("--steps must be at least 2, and the other numbers positive");
    if (c.kill_every > 0 && c.trainers < 2)
      throw corpc::bench::FlagError("kills need at least 2 trainers (a replacement recovers from another)");
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr, "ft_bench: %s\n", e.what());
    return 2;
  }

  // Every rank runs main again up to its own launch (StartMethod::spawn): only the caller makes the directory, reads
  // the timestamps and prints.
  const bool caller = !corpc::launched_rank();
  const std::string base = corpc::bench::run_base(caller, "ft_bench", "CORPC_FT_BENCH_DIR");
  if (base.empty()) return 1;
  if (caller) {
    corpc::bench::print_machine();
    const auto ks = kill_steps(c);
    std::string kill_text;
    for (auto s : ks) {
      if (!kill_text.empty()) kill_text += ',';
      kill_text += std::to_string(s);
    }
    std::printf(
        "# %d trainers, MLP 256-512-512-10, batch %lld per trainer, %lld steps; kills at steps {%s}; "
        "restart: a checkpoint every %lld steps\n",
        c.trainers, static_cast<long long>(c.batch), static_cast<long long>(c.steps), kill_text.c_str(),
        static_cast<long long>(c.checkpoint_every));
    std::fflush(stdout);
  }
  const int kills = static_cast<int>(kill_steps(c).size());
  std::vector<std::string> modes;
  if (c.mode != "restart") modes.push_back("ft");
  if (c.mode != "ft") modes.push_back("restart");

  std::vector<Result> results;
  int run = 0;
  for (int repeat = 0; repeat < c.repeats; ++repeat) {
    for (const auto& mode : modes) {
      const std::string dir = base + "/" + std::to_string(run++) + "-" + mode;
      if (caller) {
        fs::create_directory(dir);
        if (mode == "restart" && !results.empty() && results.back().mode == "ft" && results.back().repeat == repeat &&
            !results.back().failed)
          corpc::bench::write_kills(dir + "/kills", results.back().kill_list);
      }
      corpc::LaunchOptions options;
      options.timeout = std::chrono::seconds(c.timeout_s);
      std::string error;
      int restarts = 0;
      const std::int64_t t0 = now_ns();
      try {
        if (mode == "ft") {
          options.max_rank_restarts = kills;
          corpc::launch_processes(
              c.trainers + 1, [&](int rank) { ft_rank(c, dir, rank); }, options);
        } else {
          options.grace = std::chrono::milliseconds(0);  // the rest of the group is killed at once
          restarts = corpc::ddp::launch_with_restarts(
              c.trainers, [&](int rank, int restart) { restart_rank(c, dir, rank, restart); }, kills + 2, options);
        }
      } catch (const std::exception& e) {
        error = e.what();
      }
      const std::int64_t t1 = now_ns();
      if (!caller) continue;
      Result r;
      if (c.verbose) std::printf("# run %d (%s):\n", run - 1, mode.c_str());
      if (error.empty()) {
        r = analyse(c, mode, dir, t0, t1);
      } else {
        r.failed = true;
        r.error = error;
      }
      r.mode = mode;
      r.repeat = repeat;
      r.restarts = restarts;
      if (r.failed) std::printf("# %s run %d failed: %s\n", mode.c_str(), repeat, r.error.c_str());
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  if (!caller) return 0;

  std::printf(
      "\n| run | mode | steps/s before 1st kill | kills | kill → next commit (ms) | kill → killed rank ready (ms) | "
      "kill → killed rank's 1st commit (ms) | kill → killed step committed (ms) | steps redone | wall (s) | "
      "goodput (steps/s) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : results) {
    if (r.failed) {
      std::printf("| %d | %s | failed | | | | | | | | |\n", r.repeat, r.mode.c_str());
      continue;
    }
    std::printf("| %d | %s | %s | %d | %s | %s | %s | %s | %lld | %.2f | %.1f |\n", r.repeat, r.mode.c_str(),
                cell(r.pre_kill_rate, "%.1f").c_str(), r.kills, cell(r.to_next_commit_ms, "%.0f").c_str(),
                cell(r.to_ready_ms, "%.0f").c_str(), cell(r.to_replacement_ms, "%.0f").c_str(),
                cell(r.to_killed_step_ms, "%.0f").c_str(), static_cast<long long>(r.redone), r.wall_s, r.goodput);
  }
  std::printf("\n");
  for (const auto& r : results) {
    if (r.failed) continue;
    if (r.mode == "ft")
      std::printf(
          "# ft run %d: %lld retries reported by the trainers, %lld recoveries, %lld steps past --steps; coordinator: "
          "%s; launch returned after %.2f s\n",
          r.repeat, static_cast<long long>(r.retries), static_cast<long long>(r.recoveries),
          static_cast<long long>(r.extra_steps), r.coordinator.c_str(), r.launch_s);
    else
      std::printf("# restart run %d: %d group restarts; launch returned after %.2f s\n", r.repeat, r.restarts,
                  r.launch_s);
  }
  double ft_sum = 0, restart_sum = 0;
  int ft_n = 0, restart_n = 0;
  for (int repeat = 0; repeat < c.repeats; ++repeat) {
    const Result *ft = nullptr, *rs = nullptr;
    for (const auto& r : results)
      if (r.repeat == repeat && !r.failed) (r.mode == "ft" ? ft : rs) = &r;
    if (ft) ft_sum += ft->goodput, ++ft_n;
    if (rs) restart_sum += rs->goodput, ++restart_n;
    if (ft && rs) std::printf("goodput ft / restart, repeat %d: %.2f\n", repeat, ft->goodput / rs->goodput);
  }
  if (ft_n > 0 && restart_n > 0 && c.repeats > 1)
    std::printf("goodput ft / restart, mean goodputs: %.2f\n", (ft_sum / ft_n) / (restart_sum / restart_n));
  corpc::bench::keep_or_remove(base, c.keep, "timestamps");
  for (const auto& r : results)
    if (r.failed) return 1;
  return 0;
}
