// Goodput under faults for pipeline × data parallelism (corpc/ddp/pipeline_replicas.hpp): R = 2 replicas of a
// K = 2 stage pipeline (1F1B), 4 workers and rank 0, trained fault tolerant against restarting the whole job from
// its last checkpoint, and the steady-state cost of fault tolerance without faults:
//
//   pp_ft_bench [--rounds 3] [--steps 200] [--kill-every 50] [--kill-offset K/2] [--checkpoint-every 50]
//               [--modes ft,restart,plain,ft0] [--micro-batches 4] [--rows 32] [--timeout 180] [--json FILE]
//               [--verbose] [--keep]
//
// The job: an MLP of 8 Linear layers of width 64 (Tanh between them; 4 per stage), seeded alike on every worker, SGD
// with momentum, mean-squared error on --rows rows per replica and step that depend only on (step, replica), cut into
// --micro-batches; one intra-op thread per process. Kills: the i-th at step offset + i·K (below --steps), worker
// 1 + i mod 4 SIGKILLs itself after its first action of that step (mid-step: its mates wait for its activations or
// it for theirs), once per kill (a marker file). Four modes, each a fresh launch_processes job of --steps steps, run
// in this order in every round:
//   ft:      fault tolerant (PipelineReplicas' default), the kills, the killed worker started again in place
//            (max_rank_restarts): its replica drops out until the new process has loaded the state of the worker at
//            its position in the other replica, and the other replica runs the step in progress again alone. A kill
//            waits while a replica is out (with its own replica out too, nobody would hold the state to recover
//            from) and until the last kill's worker is back (its replacement committed a step with both replicas):
//            it comes at the first step after both are in again, the kills after it later still, and none at
//            or past --steps. So when a replacement takes longer to start than --kill-every steps, ft makes fewer
//            kills than planned (the "kills" column). The workers go on past --steps until both replicas are back
//            (those steps count for nothing here).
//   restart: fault_tolerant = false, every worker saving its stages' parameters and optimizer states (torch::save)
//            every --checkpoint-every steps; a kill ends the job (no rank restarts; the launcher kills the rest at
//            once, grace 0, as torchelastic's agent stops the group), and this process launches it again, every
//            worker loading the last checkpoint all workers completed. It makes the ft run's kills of the same round
//            (the same workers at the same steps, each once), or the plan's without one.
//   plain:   fault_tolerant = false, no kills, no checkpoints: the steady-state step.
//   ft0:     ft without kills: against plain, the steady-state cost of fault tolerance.
//
// Every process appends "event step t_ns" lines (steady_clock: CLOCK_MONOTONIC, one clock for the host) to a file
// of its own, a kill's just before raise(SIGKILL); after each job this process reads them. Goodput = --steps / wall,
// wall from the (first) launch to --steps' last step committed after the last kill, process starts and restarts
// included. Step time: the mean time per step between the first commits of step 10 and of the last step (ft and
// restart: the step before the first kill). Per kill: the time to the next commit of the survivors (ft: the other
// replica, of the killed step or a later one; restart: the restarted job's first), and to the killed worker's
// replacement's first commit. Numbers only, no thresholds. The ranks log errors only (CORPC_LOG=error unless set).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <corpc/corpc.hpp>
#include <corpc/ddp/fault_tolerant.hpp>
#include <corpc/ddp/pipeline_replicas.hpp>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "ft_events.hpp"

namespace {

namespace fs = std::filesystem;
using corpc::bench::cell;
using corpc::bench::Event;
using corpc::bench::EventLog;
using corpc::bench::Kill;  // Kill::worker: the worker's RPC rank
using corpc::bench::max_or_none;
using corpc::bench::median_or_none;
using corpc::bench::now_ns;

constexpr int kReplicas = 2;  // R
constexpr int kStages = 2;    // K, one per worker under 1F1B
constexpr int kWorkers = kReplicas * kStages;
constexpr int kLayers = 8;
constexpr int kWidth = 64;
constexpr std::int64_t kWarmup = 10;  // steps left out of the step time

struct Config {
  int rounds = 3;
  std::int64_t steps = 200;
  std::int64_t kill_every = 50;   // 0: no kills (ft and restart then run without faults)
  std::int64_t kill_offset = -1;  // -1: kill_every / 2
  std::int64_t checkpoint_every = 50;
  std::vector<std::string> modes = {"ft", "restart", "plain", "ft0"};
  int micro_batches = 4;
  std::int64_t rows = 32;
  int timeout_s = 180;  // per launch
  std::string json;
  bool verbose = false;
  bool keep = false;
};

// The planned kills, in order: the i-th at step offset + i·K, worker 1 + i mod 4.
std::vector<Kill> planned_kills(const Config& c) {
  std::vector<Kill> kills;
  for (std::int64_t s : corpc::bench::kill_steps(c.steps, c.kill_every, c.kill_offset))
    kills.push_back({s, 1 + static_cast<int>(kills.size()) % kWorkers});
  return kills;
}

// ---- the job ----

torch::nn::Sequential make_model() {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(kWidth, i + 1 < kLayers ? kWidth : 1));
    if (i + 1 < kLayers) model->push_back(torch::nn::Tanh());
  }
  return model;
}

at::Tensor mse(const at::Tensor& output, const at::Tensor& target) { return torch::mse_loss(output, target); }

std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(std::move(params), torch::optim::SGDOptions(0.01).momentum(0.9));
}

// Replica `replica`'s share of step `step`: the same in every mode, whichever process computes it.
std::pair<at::Tensor, at::Tensor> batch(const Config& c, std::int64_t step, int replica) {
  auto gen = at::detail::createCPUGenerator(static_cast<std::uint64_t>(step * 1000 + replica));
  auto x = torch::randn({c.rows, kWidth}, gen);
  return {x, x.sum(1, true).sin()};
}

bool fault_tolerant(const std::string& mode) { return mode == "ft" || mode == "ft0"; }

corpc::ddp::PipelineReplicaOptions replica_options(const Config& c, const std::string& mode) {
  corpc::ddp::PipelineReplicaOptions o;
  o.replicas = kReplicas;
  o.balance = std::vector<int>(kStages, 2 * kLayers / kStages);  // Linear + Tanh per layer
  o.balance.back() -= 1;                                         // but the last: the output
  o.schedule = corpc::pipeline::Schedule::OneFOneB;
  o.micro_batches = c.micro_batches;
  o.fault_tolerant = fault_tolerant(mode);
  return o;
}

// Whether kill `i` is still to happen; claim_kill takes it (true for one process only, ever, in this run's
// directory), so that a restarted job, or a replacement that reaches the step again, does not repeat it.
std::string kill_marker(const std::string& dir, std::size_t i) { return dir + "/marks/kill-" + std::to_string(i); }
bool kill_pending(const std::string& dir, std::size_t i) { return ::access(kill_marker(dir, i).c_str(), F_OK) != 0; }
bool touch_new(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}
bool claim_kill(const std::string& dir, std::size_t i) { return touch_new(kill_marker(dir, i)); }
// Kill `i`'s worker is back: its replacement committed a step with both replicas. A kill waits for the one before it
// to be back, not only made: a worker whose last step had both replicas may not have seen the last kill yet, and a
// second worker lost in another replica before the first recovers leaves no replica to recover from.
std::string back_marker(const std::string& dir, std::size_t i) { return dir + "/marks/back-" + std::to_string(i); }
bool is_back(const std::string& dir, std::size_t i) { return ::access(back_marker(dir, i).c_str(), F_OK) == 0; }

// The kills a run makes: restart takes those the ft run of its round made ("kills", written by this process before
// the launch), else the plan's; plain and ft0 none.
std::vector<Kill> run_kills(const Config& c, const std::string& mode, const std::string& dir) {
  if (mode == "plain" || mode == "ft0") return {};
  if (mode == "restart")
    if (auto made = corpc::bench::read_kills(dir + "/kills")) return *made;
  return planned_kills(c);
}

// ---- restart's checkpoints: <dir>/ckpt/<step>/rank<r>-stage<s>.{model,optim}.pt, then rank<r>.done ----

std::string checkpoint_dir(const std::string& dir, std::int64_t step) { return dir + "/ckpt/" + std::to_string(step); }

void save_checkpoint(const std::string& dir, int rank, std::int64_t step, corpc::ddp::PipelineReplicas& pp) {
  const std::string at = checkpoint_dir(dir, step);
  fs::create_directories(at);
  const std::string prefix = at + "/rank" + std::to_string(rank);
  for (const auto& stage : pp.stages()) {
    const std::string name = prefix + "-stage" + std::to_string(stage.stage);
    torch::save(stage.layers, name + ".model.pt");
    torch::save(*stage.optimizer, name + ".optim.pt");
  }
  // Written aside and renamed last: a worker killed mid-save leaves no "done", and its checkpoint is not loaded.
  {
    std::ofstream out(prefix + ".done.tmp");
    out << step << '\n';
  }
  fs::rename(prefix + ".done.tmp", prefix + ".done");
}

// The last step every worker completed a checkpoint at (0: none). The job before has ended entirely, so every
// worker of this one sees the same files and picks the same step.
std::int64_t last_checkpoint(const std::string& dir) {
  std::int64_t last = 0;
  for (const auto& entry : fs::directory_iterator(dir + "/ckpt")) {
    const std::int64_t step = std::stoll(entry.path().filename().string());
    bool complete = true;
    for (int rank = 1; rank <= kWorkers; ++rank)
      complete = complete && fs::exists(entry.path() / ("rank" + std::to_string(rank) + ".done"));
    if (complete) last = std::max(last, step);
  }
  return last;
}

void load_checkpoint(const std::string& dir, int rank, std::int64_t step, corpc::ddp::PipelineReplicas& pp) {
  const std::string prefix = checkpoint_dir(dir, step) + "/rank" + std::to_string(rank);
  for (auto stage : pp.stages()) {
    const std::string name = prefix + "-stage" + std::to_string(stage.stage);
    torch::load(stage.layers, name + ".model.pt");  // in place: the pipeline trains these parameters
    torch::load(*stage.optimizer, name + ".optim.pt");
  }
}

void single_threaded() {
  at::set_num_threads(1);
  corpc::bench::set_blas_threads(1);
}

// One rank of one job. `launch`: which launch of the run this is (restart launches the job again after each kill).
void run_rank(const Config& c, const std::string& mode, const std::string& dir, int rank, int launch) {
  EventLog log(dir + "/log", rank, "pp_ft_bench");
  log("start", launch);
  single_threaded();
  const auto options0 = replica_options(c, mode);
  const auto layout = corpc::ddp::layout_of(options0);
  corpc::RpcOptions rpc;  // a restarted worker rejoins (CORPC_REJOIN=1)
  rpc.worker_thread_init = [] { at::set_num_threads(1); };
  corpc::init_rpc(rank == 0 ? "coordinator" : "worker" + std::to_string(rank), rank, 1 + layout.world(), rpc);
  if (rank == 0) {
    if (!options0.fault_tolerant) {  // rank 0 only serves the averaging groups' store
      corpc::shutdown();
      return;
    }
    corpc::ddp::QuorumOptions quorum;
    quorum.replica_groups = layout.replica_groups();  // a quorum takes whole replicas
    corpc::ddp::QuorumCoordinator coordinator(quorum);
    corpc::shutdown();
    corpc::bench::log_stats(log, coordinator.stats());
    return;
  }

  const auto kills = run_kills(c, mode, dir);
  std::atomic<int> armed{-1};  // the kill this worker makes after its next action, or -1
  // Without fault tolerance the replicas count steps from 0 in every process: a restarted job's steps start at its
  // checkpoint's.
  std::int64_t offset = 0;
  auto options = options0;
  options.after_action = [&](std::int64_t step, const corpc::pipeline::Action&) {
    const int k = armed.exchange(-1);
    if (k < 0 || !claim_kill(dir, static_cast<std::size_t>(k))) return;
    log("kill", offset + step);
    ::raise(SIGKILL);
  };
  corpc::ddp::PipelineReplicas pp(make_model(), &mse, &make_sgd, options);
  if (mode == "restart") {
    offset = last_checkpoint(dir);
    if (offset > 0) load_checkpoint(dir, rank, offset, pp);
  }
  log("ready", offset);
  const auto share = [&](std::int64_t step, int replica) { return batch(c, offset + step, replica); };

  corpc::ddp::ReplicaStepReport report;
  // --verbose: where a steady step's time goes on this worker (steps 10 .. --steps, no faults): its own actions (first
  // start to last end), the averaging after its last action, and the rest of the step() call (the quorum and the
  // vote with fault tolerance; the optimizer step in both).
  double phase_wall = 0, phase_actions = 0, phase_tail = 0;
  std::int64_t phase_steps = 0;
  for (;;) {
    const std::int64_t running = pp.committed_steps() + offset;  // the step to run
    if (running >= c.steps && (!options.fault_tolerant || report.replicas.size() == kReplicas)) break;
    // ft past --steps: only until the other replica is back (see corpc/ddp/fault_tolerant.hpp, "Finishing"); slowly,
    // so that few steps are taken while its worker starts.
    if (running >= c.steps) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (std::size_t i = 0; i < kills.size(); ++i) {
      if (kills[i].worker != rank || !kill_pending(dir, i)) continue;
      if (mode == "restart") {
        if (kills[i].step == running) armed = static_cast<int>(i);
      } else {
        // ft: at the planned step, or as soon after it as both replicas are in again (with one out, nobody would
        // hold the state to recover from), after the kills before it and before --steps.
        bool in_order = true;
        for (std::size_t j = 0; j < i; ++j) in_order = in_order && !kill_pending(dir, j) && is_back(dir, j);
        if (in_order && kills[i].step <= running && running < c.steps && report.replicas.size() == kReplicas)
          armed = static_cast<int>(i);
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    report = pp.step(share);
    const double wall_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    armed = -1;
    if (c.verbose && running >= 10 && running < c.steps && report.ft.retries == 0 && !report.worker.records.empty()) {
      std::int64_t first = INT64_MAX, last = 0, averaged = 0;
      for (const auto& r : report.worker.records) first = std::min(first, r.start_ns), last = std::max(last, r.end_ns);
      for (const auto& a : report.averaging) averaged = std::max(averaged, a.finished_ns);
      phase_wall += wall_ms;
      phase_actions += static_cast<double>(last - first) / 1e6;
      phase_tail += static_cast<double>(std::max<std::int64_t>(0, averaged - last)) / 1e6;
      ++phase_steps;
    }
    const std::int64_t step = options.fault_tolerant ? report.ft.quorum.step : running;
    if (report.ft.recovered) log("recovered", step);
    for (int i = 0; i < report.ft.retries; ++i) log("retry", step);
    log("commit", step);
    if (corpc::rank_restart_count() > 0 && report.replicas.size() == kReplicas)
      for (std::size_t i = 0; i < kills.size(); ++i)
        if (kills[i].worker == rank && !kill_pending(dir, i) && !is_back(dir, i)) touch_new(back_marker(dir, i));
    if (mode == "restart" && c.checkpoint_every > 0 && (step + 1) % c.checkpoint_every == 0 && step + 1 < c.steps) {
      save_checkpoint(dir, rank, step + 1, pp);
      log("checkpoint", step + 1);
    }
  }
  log("done", pp.committed_steps() + offset);
  if (c.verbose && phase_steps > 0) {
    const double n = static_cast<double>(phase_steps);
    std::fprintf(stderr,
                 "# %s worker %d, per steady step (%lld): step() %.2f ms = actions %.2f + averaging after them "
                 "%.2f + the rest %.2f\n",
                 mode.c_str(), rank, static_cast<long long>(phase_steps), phase_wall / n, phase_actions / n,
                 phase_tail / n, (phase_wall - phase_actions - phase_tail) / n);
  }
  corpc::shutdown();
}

// ---- reading the timestamps ----

struct Result {
  int round = 0;
  std::string mode;
  bool failed = false;
  std::string error;
  int launches = 0;
  double wall_s = 0;    // the first launch → the last step committed
  double launch_s = 0;  // the first launch → the last launch returned
  double goodput = 0;   // steps / wall_s
  double step_ms = -1;  // steady state (ft, restart: before the first kill)
  std::vector<Kill> kills;
  std::vector<double> to_next_commit_ms;  // per kill
  std::vector<double> to_replacement_ms;  // per kill: the killed worker's new process's first commit
  std::int64_t redone = 0;                // restart: steps committed again
  std::int64_t retries = 0, recoveries = 0, extra_steps = 0;
  std::string coordinator;
};

void analyse(const Config& c, const std::string& dir, std::int64_t t0, Result& r) {
  const auto run = corpc::bench::read_events(dir + "/log");
  const auto tally = corpc::bench::tally(run, c.steps);
  r.retries = tally.retries;
  r.recoveries = tally.recoveries;
  r.coordinator = tally.coordinator;
  for (const Event* k : tally.kills) r.kills.push_back({k->step, k->rank});
  r.extra_steps = tally.extra_steps;
  const auto end = corpc::bench::job_end(run, tally, c.steps);
  if (!end) {
    r.failed = true;
    r.error = "step " + std::to_string(c.steps - 1) + " was never committed";
    return;
  }
  r.wall_s = static_cast<double>(*end - t0) / 1e9;
  r.goodput = static_cast<double>(c.steps) / r.wall_s;
  if (const auto span = corpc::bench::steady_span(tally, c.steps, kWarmup))
    r.step_ms = static_cast<double>(span->ns) / 1e6 / static_cast<double>(span->steps);

  for (const Event* k : tally.kills) {
    using corpc::bench::first_after;
    // ft: a survivor's commit of the killed step or a later one (a straggler's commit of the step before does not
    // count); restart: the restarted job's first.
    const Event* t_next = first_after(run, *k, [&](const Event& e, bool fresh) {
      return e.name == "commit" && (r.mode == "restart" ? fresh : !fresh && e.step >= k->step);
    });
    const Event* t_replacement = first_after(
        run, *k, [&](const Event& e, bool fresh) { return e.name == "commit" && fresh && e.rank == k->rank; });
    const std::int64_t next_step = t_next ? t_next->step : k->step;
    if (t_next) r.to_next_commit_ms.push_back(corpc::bench::ms_since(*k, *t_next));
    if (t_replacement) r.to_replacement_ms.push_back(corpc::bench::ms_since(*k, *t_replacement));
    r.redone += std::max<std::int64_t>(0, k->step - next_step);
    if (c.verbose) {
      auto text = [&](const Event* e) { return corpc::bench::ms_since_text(*k, e); };
      std::printf("#   kill of worker %d at step %lld: next commit (step %lld) %s, its replacement's first commit %s\n",
                  k->rank, static_cast<long long>(k->step), static_cast<long long>(next_step), text(t_next).c_str(),
                  text(t_replacement).c_str());
    }
  }
}

// ---- output ----

std::string json_number(double v) {
  if (v < 0) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4f", v);
  return buf;
}

std::string json_array(const std::vector<double>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += json_number(v[i]);
  }
  return s + "]";
}

std::string json_string(const std::string& text) {
  std::string s = "\"";
  for (unsigned char ch : text) {
    if (ch == '"' || ch == '\\') {
      s += '\\';
      s += static_cast<char>(ch);
    } else if (ch < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      s += buf;
    } else {
      s += static_cast<char>(ch);
    }
  }
  return s + "\"";
}

// Per mode, over its runs that did not fail.
struct Summary {
  int runs = 0;
  double goodput = -1, step_ms = -1;                // medians over rounds
  double to_next_commit_ms = -1, to_next_max = -1;  // median and max over all kills
  double to_replacement_ms = -1;                    // median over all kills
};

Summary summarise(const std::vector<Result>& results, const std::string& mode) {
  Summary s;
  std::vector<double> goodput, step, next, replacement;
  for (const auto& r : results) {
    if (r.mode != mode || r.failed) continue;
    ++s.runs;
    goodput.push_back(r.goodput);
    if (r.step_ms >= 0) step.push_back(r.step_ms);
    next.insert(next.end(), r.to_next_commit_ms.begin(), r.to_next_commit_ms.end());
    replacement.insert(replacement.end(), r.to_replacement_ms.begin(), r.to_replacement_ms.end());
  }
  s.goodput = median_or_none(goodput);
  s.step_ms = median_or_none(step);
  s.to_next_commit_ms = median_or_none(next);
  s.to_next_max = max_or_none(next);
  s.to_replacement_ms = median_or_none(replacement);
  return s;
}

void write_json(const Config& c, const std::vector<Result>& results, const std::map<std::string, Summary>& summary,
                double goodput_ratio, double step_ratio) {
  std::string s = "{\n";
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "  \"meta\": {\"cores\": %u, \"replicas\": %d, \"stages\": %d, \"schedule\": \"1F1B\", \"layers\": %d, "
                "\"width\": %d, \"rows\": %lld, \"micro_batches\": %d, \"steps\": %lld, \"kill_every\": %lld, "
                "\"kill_offset\": %lld, \"checkpoint_every\": %lld, \"rounds\": %d}",
                std::thread::hardware_concurrency(), kReplicas, kStages, kLayers, kWidth,
                static_cast<long long>(c.rows), c.micro_batches, static_cast<long long>(c.steps),
                static_cast<long long>(c.kill_every), static_cast<long long>(c.kill_offset),
                static_cast<long long>(c.checkpoint_every), c.rounds);
  s += buf;
  s += ",\n  \"runs\": [";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    std::string kills = "[";
    for (std::size_t k = 0; k < r.kills.size(); ++k) {
      if (k > 0) kills += ", ";
      kills +=
          "{\"step\": " + std::to_string(r.kills[k].step) + ", \"rank\": " + std::to_string(r.kills[k].worker) + "}";
    }
    kills += "]";
    s += std::string(i ? "," : "") + "\n    {\"round\": " + std::to_string(r.round) + ", \"mode\": \"" + r.mode +
         "\", \"failed\": " + (r.failed ? "true" : "false") + ", \"error\": " + json_string(r.error) +
         ", \"launches\": " + std::to_string(r.launches) + ", \"wall_s\": " + json_number(r.wall_s) +
         ", \"launch_s\": " + json_number(r.launch_s) + ", \"goodput_steps_per_s\": " + json_number(r.goodput) +
         ", \"step_ms\": " + json_number(r.step_ms) + ", \"kills\": " + kills +
         ", \"kill_to_next_commit_ms\": " + json_array(r.to_next_commit_ms) +
         ", \"kill_to_replacement_commit_ms\": " + json_array(r.to_replacement_ms) +
         ", \"steps_redone\": " + std::to_string(r.redone) + ", \"retries\": " + std::to_string(r.retries) +
         ", \"recoveries\": " + std::to_string(r.recoveries) +
         ", \"steps_past_end\": " + std::to_string(r.extra_steps) + "}";
  }
  s += "\n  ],\n  \"summary\": {";
  bool first = true;
  for (const auto& [mode, m] : summary) {
    s += std::string(first ? "" : ",") + "\n    \"" + mode + "\": {\"runs\": " + std::to_string(m.runs) +
         ", \"goodput_steps_per_s\": " + json_number(m.goodput) + ", \"step_ms\": " + json_number(m.step_ms) +
         ", \"kill_to_next_commit_ms_median\": " + json_number(m.to_next_commit_ms) +
         ", \"kill_to_next_commit_ms_max\": " + json_number(m.to_next_max) +
         ", \"kill_to_replacement_commit_ms_median\": " + json_number(m.to_replacement_ms) + "}";
    first = false;
  }
  s += std::string(first ? "" : ",") + "\n    \"goodput_ft_over_restart\": " + json_number(goodput_ratio) +
       ",\n    \"step_time_ft0_over_plain\": " + json_number(step_ratio) +
       ",\n    \"note\": \"medians over rounds; ratios of the medians\"\n  }\n}\n";
  std::ofstream f(c.json);
  f << s;
  if (!f) throw std::runtime_error("cannot write " + c.json);
}

std::vector<std::string> split_modes(const std::string& text) {
  std::vector<std::string> modes;
  for (std::size_t pos = 0; pos <= text.size();) {
    const auto comma = std::min(text.find(',', pos), text.size());
    const std::string mode = text.substr(pos, comma - pos);
    if (mode != "ft" && mode != "restart" && mode != "plain" && mode != "ft0")
      throw corpc::bench::FlagError("--modes: a comma-separated list of ft, restart, plain, ft0");
    modes.push_back(mode);
    pos = comma + 1;
  }
  return modes;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  try {
    corpc::bench::Flags flags(argc, argv,
                              {"rounds", "steps", "kill-every", "kill-offset", "checkpoint-every", "modes",
                               "micro-batches", "rows", "timeout", "json"},
                              {"verbose", "keep", "help"});
    if (flags.has("help")) {
      std::printf(
          "usage: pp_ft_bench [--rounds 3] [--steps 200] [--kill-every 50] [--kill-offset K/2] "
          "[--checkpoint-every 50] [--modes ft,restart,plain,ft0] [--micro-batches 4] [--rows 32] [--timeout 180] "
          "[--json FILE] [--verbose] [--keep]\n");
      return 0;
    }
    flags.check();
    c.rounds = flags.get_int<int>("rounds", c.rounds);
    c.steps = flags.get_int<std::int64_t>("steps", c.steps);
    c.kill_every = flags.get_int<std::int64_t>("kill-every", c.kill_every);
    c.kill_offset = flags.get_int<std::int64_t>("kill-offset", c.kill_every / 2);
    c.checkpoint_every = flags.get_int<std::int64_t>("checkpoint-every", c.checkpoint_every);
    if (flags.has("modes")) c.modes = split_modes(flags.get("modes", ""));
    c.micro_batches = flags.get_int<int>("micro-batches", c.micro_batches);
    c.rows = flags.get_int<std::int64_t>("rows", c.rows);
    c.timeout_s = flags.get_int<int>("timeout", c.timeout_s);
    c.json = flags.get("json", c.json);
    c.verbose = flags.has("verbose");
    c.keep = flags.has("keep");
    if (c.steps < 2 * kWarmup || c.rounds < 1 || c.micro_batches < 1 || c.rows < c.micro_batches || c.timeout_s < 1 ||
        c.kill_every < 0 || c.kill_offset < 0 || c.checkpoint_every < 0)
      throw corpc::bench::FlagError("--steps must be at least " + std::to_string(2 * kWarmup) +
                                    ", --rows at least --micro-batches, and the other numbers positive");
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr, "pp_ft_bench: %s\n", e.what());
    return 2;
  }

  // Every rank runs main again up to its own launch (StartMethod::spawn): only the caller makes the directories, reads
  // the timestamps and prints. What decides which launch comes next (the flags, earlier launches' outcomes, which a
  // rank replays) is the same in both.
  const bool caller = !corpc::launched_rank();
  const std::string base = corpc::bench::run_base(caller, "pp_ft_bench", "CORPC_PP_FT_BENCH_DIR");
  if (base.empty()) return 1;
  if (caller) {
    corpc::bench::print_machine();
    std::string kill_text;
    for (const auto& k : planned_kills(c)) {
      if (!kill_text.empty()) kill_text += ", ";
      kill_text += std::to_string(k.step) + ": worker " + std::to_string(k.worker);
    }
    std::printf(
        "# %d replicas × %d stages (1F1B), MLP %d × %d, %lld rows per replica in %d micro-batches, %lld steps; "
        "kills {%s}; restart: a checkpoint every %lld steps\n",
        kReplicas, kStages, kLayers, kWidth, static_cast<long long>(c.rows), c.micro_batches,
        static_cast<long long>(c.steps), kill_text.c_str(), static_cast<long long>(c.checkpoint_every));
    std::fflush(stdout);
  }
  const int planned = static_cast<int>(planned_kills(c).size());

  std::vector<Result> results;
  int run = 0;
  for (int round = 0; round < c.rounds; ++round) {
    for (const auto& mode : c.modes) {
      const std::string dir = base + "/" + std::to_string(run++) + "-" + mode;
      if (caller) {
        for (const char* sub : {"log", "ckpt", "marks"}) fs::create_directories(dir + "/" + sub);
        // restart makes the kills of this round's ft run, if it ran.
        if (mode == "restart")
          for (const auto& r : results)
            if (r.round == round && r.mode == "ft" && !r.failed) corpc::bench::write_kills(dir + "/kills", r.kills);
      }
      const int kills = mode == "ft" || mode == "restart" ? planned : 0;
      corpc::LaunchOptions options;
      options.timeout = std::chrono::seconds(c.timeout_s);
      Result r;
      r.round = round;
      r.mode = mode;
      const std::int64_t t0 = now_ns();
      if (mode == "restart") {
        // Each kill fails a launch; the next starts from the last checkpoint. A launch that fails more often than
        // there are kills (plus one spare) is an error.
        options.grace = std::chrono::milliseconds(0);
        for (int launch = 0;; ++launch) {
          r.launches = launch + 1;
          try {
            corpc::launch_processes(
                1 + kWorkers, [&](int rank) { run_rank(c, mode, dir, rank, launch); }, options);
            break;
          } catch (const std::exception& e) {
            if (launch >= kills + 1) {
              r.failed = true;
              r.error = e.what();
              break;
            }
            if (caller && c.verbose) std::printf("# restart: launch %d ended: %s\n", launch, e.what());
          }
        }
      } else {
        options.max_rank_restarts = kills;
        r.launches = 1;
        try {
          corpc::launch_processes(
              1 + kWorkers, [&](int rank) { run_rank(c, mode, dir, rank, 0); }, options);
        } catch (const std::exception& e) {
          r.failed = true;
          r.error = e.what();
        }
      }
      if (!caller) continue;
      r.launch_s = static_cast<double>(now_ns() - t0) / 1e9;
      if (c.verbose) std::printf("# run %d (%s, round %d):\n", run - 1, mode.c_str(), round);
      if (!r.failed) analyse(c, dir, t0, r);
      if (r.failed) std::printf("# %s run of round %d failed: %s\n", mode.c_str(), round, r.error.c_str());
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  if (!caller) return 0;

  std::printf(
      "\n| round | mode | launches | kills | step (ms) | kill → next commit (ms, median / max) | "
      "kill → replacement's 1st commit (ms, median) | steps redone | retries | wall (s) | goodput (steps/s) |\n"
      "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& r : results) {
    if (r.failed) {
      std::printf("| %d | %s | %d | failed | | | | | | | |\n", r.round, r.mode.c_str(), r.launches);
      continue;
    }
    std::printf("| %d | %s | %d | %zu | %s | %s / %s | %s | %lld | %lld | %.2f | %.1f |\n", r.round, r.mode.c_str(),
                r.launches, r.kills.size(), cell(r.step_ms, "%.2f").c_str(),
                cell(median_or_none(r.to_next_commit_ms), "%.0f").c_str(),
                cell(max_or_none(r.to_next_commit_ms), "%.0f").c_str(),
                cell(median_or_none(r.to_replacement_ms), "%.0f").c_str(), static_cast<long long>(r.redone),
                static_cast<long long>(r.retries), r.wall_s, r.goodput);
  }
  for (const auto& r : results)
    if (!r.failed && r.mode == "ft")
      std::printf(
          "# ft round %d: %zu of %d planned kills made, %lld recoveries, %lld steps past --steps; "
          "coordinator: %s; launch returned after %.2f s\n",
          r.round, r.kills.size(), planned, static_cast<long long>(r.recoveries), static_cast<long long>(r.extra_steps),
          r.coordinator.c_str(), r.launch_s);

  std::map<std::string, Summary> summary;
  for (const auto& mode : c.modes) summary[mode] = summarise(results, mode);
  std::printf(
      "\nMedians over rounds (kill times: over every kill of every round):\n\n"
      "| mode | runs | goodput (steps/s) | step (ms) | kill → next commit (ms, median / max) | "
      "kill → replacement's 1st commit (ms) |\n|---|---:|---:|---:|---:|---:|\n");
  for (const auto& mode : c.modes) {
    const auto& m = summary[mode];
    std::printf("| %s | %d | %s | %s | %s / %s | %s |\n", mode.c_str(), m.runs, cell(m.goodput, "%.1f").c_str(),
                cell(m.step_ms, "%.2f").c_str(), cell(m.to_next_commit_ms, "%.0f").c_str(),
                cell(m.to_next_max, "%.0f").c_str(), cell(m.to_replacement_ms, "%.0f").c_str());
  }
  std::printf("\n");
  double goodput_ratio = -1, step_ratio = -1;
  if (summary.count("ft") && summary.count("restart") && summary["ft"].runs > 0 && summary["restart"].runs > 0) {
    goodput_ratio = summary["ft"].goodput / summary["restart"].goodput;
    std::string rounds;
    for (int round = 0; round < c.rounds; ++round) {
      const Result *ft = nullptr, *rs = nullptr;
      for (const auto& r : results) {
        if (r.round != round || r.failed) continue;
        if (r.mode == "ft") ft = &r;
        if (r.mode == "restart") rs = &r;
      }
      if (!ft || !rs) continue;
      if (!rounds.empty()) rounds += ", ";
      rounds += cell(ft->goodput / rs->goodput, "%.2f");
    }
    std::printf("goodput ft / restart: %.2f (per round: %s)\n", goodput_ratio, rounds.c_str());
  }
  if (summary.count("ft0") && summary.count("plain") && summary["ft0"].step_ms > 0 && summary["plain"].step_ms > 0) {
    step_ratio = summary["ft0"].step_ms / summary["plain"].step_ms;
    std::printf("step time ft0 / plain: %.3f: fault tolerance costs %+.1f%% per step without faults\n", step_ratio,
                (step_ratio - 1) * 100);
  }
  if (!c.json.empty()) {
    write_json(c, results, summary, goodput_ratio, step_ratio);
    std::printf("wrote %s\n", c.json.c_str());
  }
  corpc::bench::keep_or_remove(base, c.keep, "timestamps and checkpoints");
  for (const auto& r : results)
    if (r.failed) return 1;
  return 0;
}
