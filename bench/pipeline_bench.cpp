// The main job's benchmark: ResNet50 as a torch::nn::Sequential cut into pipeline stages on worker processes, trained
// (SGD, lr 0.05, MSE on one-hot labels) under each corpc::pipeline schedule and number of micro-batches, beside
// PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial on the same network and data, run interleaved, and
// beside torch.distributed.pipelining on the same job and balance, on the same libtorch where corpc is built against
// the PyTorch that runs it (scripts/benchmark.sh: both 2.14, in the Debian testing root).
//
//   pipeline_bench                          # batch 32 of 64x64 images, 3 timed batches, splits 1 2 4 8, 1 thread each,
//                                           # every (schedule, split) run --repeats 3 times
//   pipeline_bench --tutorial               # the tutorial's setting: batch 120 of 128x128 images
//   pipeline_bench --compare-pytorch        # after each split, the same split through torch.distributed.rpc (the
//                                           # tutorial) and through every schedule of torch.distributed.pipelining
//                                           # (bench/pytorch_pipelining.py), both run by --python (/usr/bin/python3)
//   pipeline_bench --compare-pytorch --pipelining-python 'CMD'   # CMD runs the pipelining script instead (an
//                                           # interpreter or a command prefix with torch >= 2.4); 'off' leaves it out
//   pipeline_bench --results FILE           # also writes corpc's best run per split and its one process to FILE
//   pipeline_bench --column FILE            # adds those of another build (its --results) as columns of the summary
//   pipeline_bench --schedules gpipe,1f1b,interleaved,zbh1 --balance schedule|measured|time|tutorial|11,12 --workers 2
//   pipeline_bench --repeats 5 --send-cost 0.0005   # runs per cell; seconds per message the balance's simulation
//                                           # starts from (the rounds of real steps fit it)
//   pipeline_bench --refine-rounds 0        # --balance schedule from the profile alone, no rounds of real steps
//   pipeline_bench --trace pipeline_trace.json --gantt pipeline_gantt.png   # the last timed step of every run
//   pipeline_bench --device cuda:0          # every stage on that device (workers "workerN/cuda:0"), the reference too
//
// Prints, per schedule and split: the time of the timed batches (the median of the repeated runs and their range), the
// cut it ran with and its simulated step beside the measured one, the bubble measured from the workers' timelines
// beside the schedule's formula, each worker's peak activation memory, micro-batches held, CPU time and threads, and
// PyTorch's time;
// with --compare-pytorch also each torch.distributed.pipelining schedule's time per split (or how it failed: a hang,
// an exception, a loss that is NaN or differs from the one-process loss) and, per split, corpc's best against
// pipelining's best, the tutorial's time, and one process.
//
// Repeats are interleaved so that what the machine does in one minute lands on both sides: per split, every corpc
// schedule once, then every pipelining schedule once (one run of the script), and again, --repeats times; after the
// splits, the one-process references the same way (C++, then Python, --repeats times). The summary compares medians.
//
// The balance: "schedule" (the default) profiles each layer's forward, input-gradient and weight-gradient time at the
// micro-batch size of each split, cuts each (schedule, split) where the schedule's simulated step is shortest
// (corpc/pipeline/schedule_balance.hpp), then refines that cut with up to three rounds of real steps
// (refine_balance_for_pipeline: the profile calibrated stage by stage and kind by kind, the time per message fitted
// to the step's span), keeping the cut whose step measured fastest; "time" and "measured" cut once per stage count as
// balance_by_time (and refine_balance) do. The table shows the step the simulation predicted for the cut that ran.
//
// With --device cuda:N the workers share that GPU: activations and gradients go from stage to stage through device
// maps (cuda:N -> cuda:N between every two workers; the master sends only CPU inputs and targets), the balance is
// profiled on the device, and the timed batches end with a synchronize of every worker's device. Timelines (the
// bubble column) record host time, which on a GPU is when kernels were queued, not when they ran; the peak column
// counts the CPU allocator only. PyTorch's side gets --device too (bench/pytorch_pipeline.py: the tutorial's shards
// on the device, tensors crossing RPC on the CPU).
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <map>
#include <sstream>

#include "corpc/corpc.hpp"
#include "corpc/pipeline/pipeline.hpp"

#include "../tools/gantt.hpp"
#include "bench_util.hpp"
#include "resnet_shards.hpp"

using namespace corpc;
using namespace corpc::examples;
using namespace corpc::pipeline;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  std::vector<long> splits;
  std::vector<Schedule> schedules;
  std::string balance;
  long batch, image, batches, threads, width, classes, warmup, workers;
  std::string device = "cpu";  // of every stage: "cpu" or "cuda:N"
  std::string python = "/usr/bin/python3";
  // torch.distributed.pipelining (bench/pytorch_pipelining.py): the command prefix that runs the script, or empty and
  // why it does not run.
  std::string pipelining, pipelining_script = "bench/pytorch_pipelining.py", pipelining_missing;
  std::string pipelining_torch = "?";  // the version the pipelining script reported
  long pipelining_timeout = 180;       // seconds for each (schedule, splits) run
  long repeats = 3;                    // runs of every (schedule, split) cell and of each one-process reference
  double send_seconds = 0;             // per message between workers, in the balance's simulation
  long refine_rounds = 3;              // --balance schedule: rounds of real steps that refine the profile's cut
};

// What a process used: CPU time (user + system, getrusage) and the threads torch runs with, so that a gap between two
// runs can be told from one that ran more threads or waited more.
struct Usage {
  double cpu_seconds = 0;
  std::int32_t threads = 0, interop_threads = 0;
  CORPC_FIELDS(cpu_seconds, threads, interop_threads)
};
Usage process_usage() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto secs = [](const timeval& t) { return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6; };
  return {secs(u.ru_utime) + secs(u.ru_stime), at::get_num_threads(), at::get_num_interop_threads()};
}

// "workerN/<device>": worker w's name and its stages' device, as PipelineOptions::workers takes them.
std::string worker_spec(const Config& c, long w) { return "worker" + std::to_string(w) + "/" + c.device; }

// Waits for everything queued on `device` (a string, to travel as an RPC argument); nothing to wait for on the CPU.
void synchronize_device(std::string device) {
  const c10::Device d(device);
  if (d.is_cuda()) at::detail::getCUDAHooks().deviceSynchronize(d.index());
}
// The same on every worker of the pipeline, so that a timed batch's clock stops after its last kernel.
void synchronize_workers(const Config& c) {
  if (c.device == "cpu") return;
  for (long w = 1; w <= c.workers; ++w) rpc_sync<&synchronize_device>("worker" + std::to_string(w), c.device);
}

const std::vector<std::int64_t> kBlocks{3, 4, 6, 3};
long g_classes = 1000;

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::nn::functional::mse_loss(out, target); }
std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05));
}
torch::nn::Sequential resnet50(std::int64_t width, std::int64_t classes) {
  return make_resnet_sequential(width, kBlocks, classes, 0);
}

// Training-mode BatchNorm needs more than one value per channel; layer4's maps are image/32 wide.
bool micro_batch_too_small(const Config& c, long splits) {
  long hw = c.image;
  for (int i = 0; i < 5; ++i) hw = (hw - 1) / 2 + 1;
  long smallest = c.batch / splits;
  if (c.batch % splits) smallest = c.batch - (splits - 1) * ((c.batch + splits - 1) / splits);
  return smallest * hw * hw < 2;
}

std::vector<std::pair<at::Tensor, at::Tensor>> make_data(const Config& c) {
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (long b = 0; b < c.batches; ++b)
    data.emplace_back(random_images(c.batch, c.image, 1000 + b), one_hot_labels(c.batch, c.classes, 2000 + b));
  return data;
}

std::string to_string(const std::vector<int>& balance) {
  std::string s;
  for (std::size_t i = 0; i < balance.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(balance[i]);
  }
  return s;
}

// "measured": balance-by-time, then up to three rounds of refine_balance, each from the timeline of one step (after
// one warm-up step) of `schedule` (one that places the stages as the runs will), at 4 micro-batches. Keeps the
// balance whose slowest stage measured fastest: with several stages per worker, one round's correction can overshoot.
std::vector<int> refine_by_steps(const Config& c, Schedule schedule, int stages, std::vector<double> costs,
                                 std::vector<int> balance, const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
  PipelineOptions o;
  o.schedule = schedule;
  o.micro_batches = 4;
  for (long w = 1; w <= c.workers; ++w) o.workers.push_back(worker_spec(c, w));
  std::vector<int> best = balance;
  double best_pace = INFINITY;
  for (int round = 1; round <= 3; ++round) {
    o.balance = balance;
    auto pipe = Pipeline::create<&resnet50, &mse, &make_sgd>(o, std::int64_t{c.width}, std::int64_t{c.classes});
    sync_wait(pipe.train_step(data[0].first, data[0].second));
    auto step = sync_wait(pipe.train_step(data[0].first, data[0].second));
    const auto busy = stage_busy_seconds(step.workers, stages);
    if (const double pace = *std::max_element(busy.begin(), busy.end()); pace < best_pace)
      best_pace = pace, best = balance;
    auto next = refine_balance(costs, balance, busy);
    std::string times;
    for (double b : busy) times += (times.empty() ? "" : " / ") + std::to_string(b).substr(0, 5);
    std::fprintf(stderr, "  [balance, %d stages, %s] round %d: %s took %s s per stage -> %s\n", stages,
                 to_string(schedule), round, to_string(balance).c_str(), times.c_str(), to_string(next).c_str());
    if (next == balance) break;
    balance = std::move(next);
  }
  return best;
}

// profile_layers (corpc/pipeline/balance.hpp) on c.device: on a GPU every timed run ends with a synchronize of the
// device, or the clock would read how long the kernels took to queue.
std::vector<double> profile_on_device(const Config& c, torch::nn::Sequential net, const at::Tensor& sample,
                                      int repeats) {
  if (c.device == "cpu") return profile_layers(net, sample, repeats);
  const c10::Device device(c.device);
  net->to(device);
  std::vector<double> times;
  at::Tensor x = sample.to(device);
  for (auto& layer : *net) {
    std::vector<double> runs;
    at::Tensor y;
    for (int i = 0; i <= repeats; ++i) {
      at::Tensor in = x.detach().requires_grad_(x.is_floating_point());
      synchronize_device(c.device);
      const auto t0 = Clock::now();
      y = layer.forward(in);
      if (y.requires_grad()) torch::autograd::backward({y}, {at::ones_like(y)});
      synchronize_device(c.device);
      if (i > 0) runs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::nth_element(runs.begin(), runs.begin() + static_cast<long>(runs.size() / 2), runs.end());
    times.push_back(runs[runs.size() / 2]);
    x = y.detach();
  }
  return times;
}

// Each layer's F, I and W seconds (profile_layer_costs) at the micro-batch size `splits` gives (the largest
// micro-batch), on c.device, profiled once per size: what the schedule balance and the simulated-step column use.
const std::vector<ActionCosts>& layer_costs(const Config& c, long splits) {
  static std::map<long, std::vector<ActionCosts>> by_micro_batch;
  const long micro = (c.batch + splits - 1) / splits;
  auto& costs = by_micro_batch[micro];
  if (costs.empty()) {
    const c10::Device device(c.device);
    auto net = resnet50(c.width, c.classes);
    net->to(device);
    costs =
        profile_layer_costs(net, random_images(micro, c.image, 5).to(device), 2, [&] { synchronize_device(c.device); });
  }
  return costs;
}

// --balance schedule: the cut of `schedule` at `splits` micro-batches with the shortest simulated step, from the
// profile, then refined by real steps (refine_balance_for_pipeline): up to c.refine_rounds rounds, each one warm-up
// step and two timed ones with the cut, the profile calibrated with the faster step's stage costs and its span. Keeps
// the cut whose faster step was fastest (a round can overshoot); its simulated_seconds is the step predicted for it
// before it ran.
ScheduleBalance schedule_cut(const Config& c, Schedule schedule, long splits,
                             const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
  std::vector<ActionCosts> costs = layer_costs(c, splits);  // a copy: each (schedule, split) calibrates its own
  PipelineOptions o;
  o.schedule = schedule;
  o.micro_batches = static_cast<int>(splits);
  for (long w = 1; w <= c.workers; ++w) o.workers.push_back(worker_spec(c, w));
  ScheduleBalance chosen = balance_for_pipeline(o, costs, 0, c.send_seconds), best = chosen;
  double best_pace = INFINITY;
  std::vector<std::vector<int>> tried;
  for (long round = 1; round <= c.refine_rounds; ++round) {
    o.balance = chosen.balance;
    tried.push_back(o.balance);
    auto pipe = Pipeline::create<&resnet50, &mse, &make_sgd>(o, std::int64_t{c.width}, std::int64_t{c.classes});
    sync_wait(pipe.train_step(data[0].first, data[0].second));
    synchronize_workers(c);
    double pace = INFINITY;
    std::vector<WorkerReport> fastest;
    for (int i = 0; i < 2; ++i) {
      const auto t0 = Clock::now();
      auto step = sync_wait(pipe.train_step(data[0].first, data[0].second));
      synchronize_workers(c);
      if (const double t = std::chrono::duration<double>(Clock::now() - t0).count(); t < pace)
        pace = t, fastest = std::move(step.workers);
    }
    if (pace < best_pace) best_pace = pace, best = chosen;
    auto next = refine_balance_for_pipeline(o, costs, fastest);
    std::fprintf(stderr,
                 "  [balance, %s@%ld] round %ld: %s simulated %.3f s, measured %.3f s (span %.3f) -> %s "
                 "(simulated %.3f s, %.1f ms per message)\n",
                 to_string(schedule), splits, round, to_string(o.balance).c_str(), chosen.simulated_seconds, pace,
                 step_span_seconds(fastest), to_string(next.balance).c_str(), next.simulated_seconds,
                 next.send_seconds * 1e3);
    if (std::find(tried.begin(), tried.end(), next.balance) != tried.end()) break;
    chosen = std::move(next);
  }
  return c.refine_rounds > 0 ? best : chosen;
}

// The schedule whose steps refine the balance for `stages` stages placed as `placement`: the stage times depend on
// what runs beside them on a worker.
Schedule refining_schedule(const Config& c, int stages, Placement placement) {
  if (placement == Placement::v) return Schedule::ZBVZeroBubble;
  return stages > c.workers ? Schedule::Interleaved1F1B : Schedule::OneFOneB;
}

// The key of a balance: its number of stages, "V" after it for the V placement ("4", "4V").
std::string balance_key(int stages, Placement placement) {
  return std::to_string(stages) + (placement == Placement::v ? "V" : "");
}

// Layers per stage: "tutorial" (after layer2, 2 stages), "time" (balance-by-time on a micro-batch-sized sample),
// "measured" (balance-by-time refined by the stage times of real steps with the runs' placement), or a list. (For
// "schedule", see schedule_cut: its cut depends on the schedule and the split, not only on the stage count.)
std::vector<int> make_balance(const Config& c, int stages, Placement placement,
                              const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
  if (c.balance == "tutorial" && stages == 2) return tutorial_balance(kBlocks);
  if (c.balance == "time" || c.balance == "measured" || c.balance == "tutorial") {
    auto net = resnet50(c.width, c.classes);
    auto costs = profile_on_device(c, net, random_images(std::max<long>(2, c.batch / 4), c.image, 5), 2);
    auto balance = partition_by_cost(costs, stages);
    if (c.balance == "measured")
      balance = refine_by_steps(c, refining_schedule(c, stages, placement), stages, std::move(costs),
                                std::move(balance), data);
    return balance;
  }
  std::vector<int> out;
  std::stringstream ss(c.balance);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoi(item));
  return out;
}

// Where a step's time goes beyond its compute: the span of one step's actions (first start to last end, over the
// workers) and the step the simulation gives when each stage's actions take what they took in that step (their mean
// per kind: F; I, or a whole B; W). Span minus replay: waits the durations do not explain (messages, wake-ups);
// the wall-clock step minus the span: the step's start and end (the master's calls, the optimizer step).
struct StepAccount {
  double span = 0, replay = 0;  // seconds
};
StepAccount account_step(const Config& c, Schedule schedule, long splits, const std::vector<WorkerReport>& workers) {
  const int v = min_stages_per_worker(schedule), stages = static_cast<int>(c.workers) * v;
  StepAccount a;
  a.span = step_span_seconds(workers);
  a.replay = simulate_step(make_schedule(schedule, static_cast<int>(c.workers), v, static_cast<int>(splits)),
                           stage_action_costs(workers, stages));
  return a;
}

struct RunResult {
  double seconds = 0, bubble = 0;
  std::vector<Usage> usage;              // per worker: CPU seconds over the timed steps, threads
  std::vector<WorkerReport> last;        // the last timed step
  std::vector<std::int64_t> peak_bytes;  // per worker, over the timed steps
  std::vector<int> held;
};

RunResult run_pipeline(const Config& c, Schedule schedule, long splits, const std::vector<int>& balance,
                       const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
  PipelineOptions o;
  o.schedule = schedule;
  o.micro_batches = static_cast<int>(splits);
  for (long w = 1; w <= c.workers; ++w) o.workers.push_back(worker_spec(c, w));
  o.balance = balance;
  auto pipe = Pipeline::create<&resnet50, &mse, &make_sgd>(o, std::int64_t{c.width}, std::int64_t{c.classes});
  for (long w = 0; w < c.warmup; ++w) sync_wait(pipe.train_step(data[0].first, data[0].second));
  synchronize_workers(c);
  RunResult r;
  for (long w = 1; w <= c.workers; ++w) r.usage.push_back(rpc_sync<&process_usage>("worker" + std::to_string(w)));
  r.peak_bytes.assign(c.workers, 0);
  r.held.assign(c.workers, 0);
  auto t0 = Clock::now();
  for (long b = 0; b < c.batches; ++b) {
    auto tb = Clock::now();
    auto step = sync_wait(pipe.train_step(data[b].first, data[b].second));
    std::fprintf(stderr, "  [%s, %ld split%s] batch %ld/%ld: %.2f s, loss %.5f\n", to_string(schedule), splits,
                 splits == 1 ? "" : "s", b + 1, c.batches, std::chrono::duration<double>(Clock::now() - tb).count(),
                 step.loss.item<double>());
    r.bubble += measured_bubble(step.workers) / static_cast<double>(c.batches);
    for (std::size_t w = 0; w < step.workers.size(); ++w) {
      r.peak_bytes[w] = std::max(r.peak_bytes[w], step.workers[w].peak_activation_bytes);
      r.held[w] = std::max(r.held[w], step.workers[w].peak_micro_batches_held);
    }
    r.last = std::move(step.workers);
  }
  synchronize_workers(c);
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  for (long w = 1; w <= c.workers; ++w) {
    const Usage after = rpc_sync<&process_usage>("worker" + std::to_string(w));
    auto& u = r.usage[static_cast<std::size_t>(w - 1)];
    u = {after.cpu_seconds - u.cpu_seconds, after.threads, after.interop_threads};
  }
  return r;
}

// The same batches through the unsplit model in this process, no RPC, whole batches: the floor to beat. On the stages'
// device, the batches copied there inside the timed steps (as the pipeline's first stage does). Returns the seconds and
// this process's CPU time over them in `usage`.
double run_single_process(const Config& c, const std::vector<std::pair<at::Tensor, at::Tensor>>& data, Usage& usage) {
  const c10::Device device(c.device);
  auto net = resnet50(c.width, c.classes);
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  auto step = [&](const at::Tensor& x, const at::Tensor& y) {
    opt.zero_grad();
    mse(net->forward(x.to(device)), y.to(device)).backward();
    opt.step();
  };
  for (long w = 0; w < c.warmup; ++w) step(data[0].first, data[0].second);
  synchronize_device(c.device);
  const Usage before = process_usage();
  auto t0 = Clock::now();
  for (auto& [x, y] : data) step(x, y);
  synchronize_device(c.device);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  usage = process_usage();
  usage.cpu_seconds -= before.cpu_seconds;
  return seconds;
}

// bench/pytorch_pipeline.py for one split; seconds, or NAN if it did not run.
double run_pytorch(const Config& c, long split, const std::string& script) {
  std::ostringstream cmd;
  cmd << c.python << " " << script << " --batch-size " << c.batch << " --image-size " << c.image << " --num-batches "
      << c.batches << " --threads " << c.threads << " --base-width " << c.width << " --num-classes " << c.classes
      << " --warmup " << c.warmup << " --splits " << split;
  if (c.device != "cpu") cmd << " --device " << c.device;
  cmd << " 2>/dev/null";
  std::fprintf(stderr, "# running PyTorch: %s\n", cmd.str().c_str());
  double out = NAN;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return out;
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    std::string l(line);
    if (l.rfind("JSON: ", 0) != 0) {
      std::fprintf(stderr, "  [pytorch] %s", line);
      continue;
    }
    auto key = l.find("\"" + std::to_string(split) + "\"");
    if (key != std::string::npos) out = std::stod(l.substr(l.find(':', key) + 1));
  }
  ::pclose(p);
  return out;
}

// Runs `command` (through the shell), returning its output's lines (stdout and stderr) and its exit status (-1: it
// did not start or end normally); each line is also passed to `each` as it comes.
std::pair<std::vector<std::string>, int> run_command(const std::string& command,
                                                     const std::function<void(const std::string&)>& each = {}) {
  std::vector<std::string> lines;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (!p) return {lines, -1};
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    std::string l(line);
    if (!l.empty() && l.back() == '\n') l.pop_back();
    if (each) each(l);
    lines.push_back(l);
  }
  const int status = ::pclose(p);
  return {lines, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

// Decides how bench/pytorch_pipelining.py runs: --pipelining-python CMD, else --python (the tutorial's interpreter);
// then asks the script whether torch.distributed.pipelining imports (through sudo, where CMD enters a root: a
// password prompt comes here, before the run). Sets c.pipelining and c.pipelining_torch, or clears c.pipelining and
// says why in c.pipelining_missing.
void resolve_pipelining(Config& c, const bench::Flags& flags) {
  c.pipelining = flags.get("pipelining-python", c.python);
  if (c.pipelining == "off") {
    c.pipelining.clear();
    c.pipelining_missing = "--pipelining-python off";
  }
  if (!c.pipelining.empty() && c.workers != 2)
    c.pipelining_missing = "it runs on 2 ranks, not --workers " + std::to_string(c.workers);
  if (!c.pipelining.empty() && c.device != "cpu") c.pipelining_missing = "it runs on the CPU only";
  if (!c.pipelining_missing.empty()) {
    c.pipelining.clear();
    return;
  }
  auto [lines, status] = run_command(c.pipelining + " " + c.pipelining_script + " --probe");
  for (auto& l : lines)
    if (status == 0 && l.rfind("torch ", 0) == 0) {
      std::printf("# torch.distributed.pipelining: %s (run as: %s %s)\n", l.c_str(), c.pipelining.c_str(),
                  c.pipelining_script.c_str());
      c.pipelining_torch = l.substr(6, l.find(':') == std::string::npos ? std::string::npos : l.find(':') - 6);
      return;
    }
  c.pipelining_missing = "'" + c.pipelining + " " + c.pipelining_script +
                         " --probe' failed: " + (lines.empty() ? "no output" : lines.back());
  c.pipelining.clear();
}

// bench/pytorch_pipelining.py for one split, every schedule that one of `cuts` (corpc's balances for 2 and 4 stages)
// fits: GPipe and 1F1B on 2 stages, the others on 4. Its result lines go to `out` as they are ("pipelining SCHEDULE
// SPLITS SECONDS|FAILED:WHY LOSS CHECK # detail"), each finished run's ranks' CPU time and threads as
// "pipelining-usage ...", its patch note as "pipelining-note TEXT", and a run that printed no result as
// "pipelining-error SPLITS TEXT". With `reference_only`, its one-process time alone, as "pipelining-reference SECONDS"
// and "pipelining-reference-usage CPU THREADS INTEROP".
void run_pipelining(const Config& c, long split, const std::map<int, std::vector<int>>& cuts, bool reference_only,
                    std::ostream& out) {
  if (cuts.empty() && !reference_only) {
    out << "pipelining-error " << split << " --balance " << c.balance << " cuts neither 2 nor 4 stages\n";
    return;
  }
  std::ostringstream cmd;
  cmd << c.pipelining << " " << c.pipelining_script << " --batch-size " << c.batch << " --image-size " << c.image
      << " --num-batches " << c.batches << " --threads " << c.threads << " --base-width " << c.width
      << " --num-classes " << c.classes << " --warmup " << c.warmup << " --timeout " << c.pipelining_timeout;
  if (reference_only) {
    cmd << " --reference-only";
  } else {
    cmd << " --splits " << split << " --balance";
    for (auto& [n, b] : cuts) cmd << ' ' << n << ':' << to_string(b);
    cmd << " --schedules " << (cuts.count(2) ? "GPipe,1F1B" : "") << (cuts.size() == 2 ? "," : "")
        << (cuts.count(4) ? "Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble" : "");
  }
  std::fprintf(stderr, "# running torch.distributed.pipelining: %s\n", cmd.str().c_str());
  bool any = false;
  auto [lines, status] = run_command(cmd.str(), [&](const std::string& l) {
    if (l.rfind("JSON: ", 0) == 0) return;
    std::fprintf(stderr, "  [pipelining] %s\n", l.c_str());
    if (l.rfind("pipelining ", 0) == 0 || l.rfind("pipelining-usage ", 0) == 0) {
      out << l << '\n';
      any = true;
    } else if (l.rfind("reference ", 0) == 0 || l.rfind("reference-usage ", 0) == 0) {
      out << "pipelining-" << l << '\n';
      any = true;
    } else if (l.rfind("# PATCHED", 0) == 0 || l.rfind("# NOT patched", 0) == 0) {
      out << "pipelining-note " << l.substr(2) << '\n';
    }
  });
  if (!any)
    out << "pipelining-error " << split << " exit status " << status << ": "
        << (lines.empty() ? "no output" : lines.back()) << '\n';
}

// One Gantt chart: a row per (schedule run, worker), boxes from each action's start to end, coloured by kind.
void write_gantt(const std::string& png, const std::vector<std::pair<std::string, std::vector<WorkerReport>>>& runs) {
  gantt::Chart chart;
  chart.title = "pipeline timeline (blue F, red B, orange I, green W)";
  chart.xlabel = "ms from the step start";
  chart.palette = {"#3b75af", "#c03d3e", "#ef8636", "#519e3e"};  // by ActionKind
  int row = 0;
  for (auto& [label, workers] : runs) {
    std::int64_t origin = INT64_MAX;
    for (auto& w : workers)
      for (auto& r : w.records) origin = std::min(origin, r.start_ns);
    for (auto& w : workers) {
      chart.rows.emplace_back(label + " w" + std::to_string(w.rank), row);
      for (auto& r : w.records)
        chart.boxes.push_back(
            {(r.start_ns - origin) / 1e6, (r.end_ns - origin) / 1e6, row, static_cast<int>(r.action.kind)});
      ++row;
    }
    ++row;  // a gap between runs
  }
  chart.row_count = row;
  gantt::draw(png, chart);
}

// --results / --column: corpc's best run per split and its one process, as one build measured them, so that a run
// of another build (another libtorch line) can show them beside its own.
struct OtherBuild {
  std::string label;  // its libtorch version; empty: none given
  std::map<long, double> best;
  double single = NAN;
};

template <class Rows>
void write_results(const std::string& path, const Rows& rows, double single) {
  std::ofstream out(path);
  out << "libtorch " << TORCH_VERSION << "\nsingle " << single << '\n';
  std::map<long, double> best;
  for (auto& r : rows)
    if (!best.count(r.splits) || r.median() < best[r.splits]) best[r.splits] = r.median();
  for (auto& [s, t] : best) out << "best " << s << ' ' << t << '\n';
}

OtherBuild read_other_build(const std::string& path) {
  OtherBuild o;
  if (path.empty()) return o;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "pipeline_bench: --column %s: cannot read it\n", path.c_str());
    return o;
  }
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string key;
    ls >> key;
    if (key == "libtorch") ls >> o.label;
    else if (key == "single") ls >> o.single;
    else if (key == "best") {
      long s;
      double t;
      if (ls >> s >> t) o.best[s] = t;
    }
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Flags flags(argc, argv);
  if (flags.has("help")) {
    std::puts(
        "pipeline_bench [--schedules gpipe,1f1b,interleaved,zbh1,loopedbfs,interleavedzb,zbv,dualpipev] [--splits "
        "1,2,4,8] [--balance "
        "schedule|measured|time|tutorial|N,N..]\n"
        "               [--repeats 3]   (runs of every cell and of each one-process reference, interleaved)\n"
        "               [--send-cost 0]   (seconds per message between workers in the schedule balance's simulation)\n"
        "               [--refine-rounds 3]   (--balance schedule: rounds of real steps that calibrate the profile)\n"
        "               [--workers 2] [--batch-size 32] [--image-size 64] [--num-batches 3] [--threads 1] [--warmup "
        "1]\n"
        "               [--base-width 64] [--num-classes 1000] [--tutorial] [--compare-pytorch]\n"
        "               [--pytorch-script bench/pytorch_pipeline.py] [--trace FILE.json] [--gantt FILE.png]\n"
        "               [--host-cache on|off]   (off: libtorch's own CPU allocator in every process, reference "
        "included)\n"
        "               [--device cpu|cuda:N]   (every stage there, and the one-process reference; PyTorch's too)\n"
        "               [--python /usr/bin/python3]   (the interpreter that runs --pytorch-script)\n"
        "               [--pipelining-python CMD|off] [--pipelining-script bench/pytorch_pipelining.py]\n"
        "               [--pipelining-timeout 180]   (torch.distributed.pipelining with --compare-pytorch: CMD runs "
        "the script;\n"
        "                                           default: --python)\n"
        "               [--results FILE]   (corpc's best run per split and its one process, for another run's "
        "--column)\n"
        "               [--column FILE]    (another build's --results beside this run's in the summary)");
    return 0;
  }
  const bool tutorial = flags.has("tutorial");
  Config c;
  c.splits = flags.get_list("splits", "1,2,4,8");
  {
    std::stringstream ss(flags.get("schedules", "gpipe,1f1b,interleaved,zbh1,loopedbfs,interleavedzb,zbv,dualpipev"));
    for (std::string s; std::getline(ss, s, ',');) c.schedules.push_back(schedule_from_string(s));
  }
  c.balance = flags.get("balance", "schedule");
  c.repeats = std::max<long>(1, flags.get_int("repeats", c.repeats));
  c.send_seconds = flags.get_double("send-cost", c.send_seconds);
  c.refine_rounds = std::max<long>(0, flags.get_int("refine-rounds", c.refine_rounds));
  c.batch = flags.get_int("batch-size", tutorial ? 120 : 32);
  c.image = flags.get_int("image-size", tutorial ? 128 : 64);
  c.batches = flags.get_int("num-batches", 3);
  c.threads = flags.get_int("threads", 1);
  c.width = flags.get_int("base-width", 64);
  c.classes = g_classes = flags.get_int("num-classes", 1000);
  c.warmup = flags.get_int("warmup", 1);
  c.workers = flags.get_int("workers", 2);
  c.device = flags.get("device", "cpu");
  c.python = flags.get("python", c.python);
  try {  // parsing a device string touches no driver: this process forks the ranks and must not start CUDA
    const c10::Device d(c.device);
    if (!d.is_cpu() && !(d.is_cuda() && d.has_index())) throw std::invalid_argument("not cpu or cuda:N");
    c.device = d.str();
  } catch (const std::exception&) {
    std::fprintf(stderr, "pipeline_bench: --device %s: expected cpu or cuda:N\n", c.device.c_str());
    return 2;
  }
  const bool compare = flags.has("compare-pytorch");
  const std::string script = flags.get("pytorch-script", "bench/pytorch_pipeline.py");
  const std::string trace_path = flags.get("trace", ""), gantt_path = flags.get("gantt", "");
  c.pipelining_script = flags.get("pipelining-script", c.pipelining_script);
  c.pipelining_timeout = flags.get_int("pipelining-timeout", c.pipelining_timeout);

  bench::print_machine();
  const std::string host_cache = flags.get("host-cache", "on");
  std::printf(
      "# ResNet50 (base width %ld) as a Sequential of %d layers on %ld worker processes + master, stages on %s; "
      "batch %ld of %ldx%ld images, %ld timed batches after %ld warm-up, %ld intra-op thread(s) per process; "
      "balance: %s; host cache: %s; %ld run(s) per cell\n",
      c.width, 4 + 16 + 3, c.workers, c.device.c_str(), c.batch, c.image, c.image, c.batches, c.warmup, c.threads,
      c.balance.c_str(), host_cache.c_str(), c.repeats);
  if (c.device != "cpu")
    std::printf(
        "# corpc: activations and gradients between the workers through device maps %s -> %s; PyTorch: "
        "torch.distributed.rpc (TensorPipe), the tutorial's shards on %s, tensors crossing RPC on the CPU\n",
        c.device.c_str(), c.device.c_str(), c.device.c_str());
  if (compare) {
    resolve_pipelining(c, flags);
    if (!c.pipelining_missing.empty())
      std::printf("# torch.distributed.pipelining: not run: %s\n", c.pipelining_missing.c_str());
  }
  std::fflush(stdout);

  // Results cross from rank 0 to this process through a file (ranks are separate processes).
  char path[] = "/tmp/corpc_pipeline_bench_XXXXXX";
  ::close(::mkstemp(path));
  RpcOptions options;
  options.rpc_timeout = std::chrono::minutes(10);
  options.init_timeout = std::chrono::seconds(60);
  const int threads = static_cast<int>(c.threads);
  options.worker_thread_init = [threads] { at::set_num_threads(threads); };
  // Before the ranks are forked: they inherit it.
  corpc::HostMemoryOptions memory;
  memory.cache_cpu_allocations = host_cache != "off";
  corpc::configure_host_memory(memory);
  LaunchOptions so;
  so.timeout = std::chrono::minutes(60);
  // Forked: rank 0 writes the results file this process made and reads back, and nothing here has started a thread.
  so.start = StartMethod::fork;
  const int world = static_cast<int>(c.workers) + 1;
  try {
    launch_processes(
        world,
        [&](int rank) {
          at::set_num_threads(threads);
          bench::set_blas_threads(threads);
          RpcOptions o = options;
          if (c.device != "cpu") {  // stage to stage on the device: a map between every two workers, one side sets it
            const c10::Device d(c.device);
            for (long w = rank + 1; rank >= 1 && w <= c.workers; ++w)
              o.set_device_map("worker" + std::to_string(w), {{d, d}});
          }
          init_rpc(rank == 0 ? "master" : "worker" + std::to_string(rank), rank, world, o);
          if (rank == 0) {
            auto data = make_data(c);
            std::ofstream out(path);
            std::map<std::string, std::vector<int>> balances;  // see cut_for
            ChromeTrace trace;
            std::vector<std::pair<std::string, std::vector<WorkerReport>>> gantt;
            int process = 0;
            const bool by_schedule = c.balance == "schedule";
            // By key of `balances`, for "schedule": the chosen cut's simulated step and partition_by_cost's cut's.
            std::map<std::string, std::pair<double, double>> simulated;
            // The cut `schedule` runs with at `s` micro-batches: per (schedule, split) for "schedule", else per stage
            // count and placement.
            auto cut_for = [&](Schedule schedule, long s) -> const std::vector<int>& {
              const int stages = static_cast<int>(c.workers) * min_stages_per_worker(schedule);
              const std::string key = by_schedule ? std::string(to_string(schedule)) + "@" + std::to_string(s)
                                                  : balance_key(stages, placement_of(schedule));
              if (!balances.count(key)) {
                if (by_schedule) {
                  const auto chosen = schedule_cut(c, schedule, s, data);
                  balances[key] = chosen.balance;
                  simulated[key] = {chosen.simulated_seconds, chosen.partition_seconds};
                } else {
                  balances[key] = make_balance(c, stages, placement_of(schedule), data);
                }
              }
              return balances[key];
            };
            const bool pipelining = compare && !c.pipelining.empty();
            for (long s : c.splits) {
              if (micro_batch_too_small(c, s)) {
                std::fprintf(
                    stderr, "  [%ld splits] skipped: a micro-batch this small leaves one value per BatchNorm channel\n",
                    s);
                continue;
              }
              // Pipelining's schedules of 2 and 4 stages, cut as corpc's 1F1B and Interleaved1F1B runs, for the
              // stage counts that --schedules runs (so that a narrower run compares what it runs).
              std::map<int, std::vector<int>> cuts;
              for (auto schedule : {Schedule::OneFOneB, Schedule::Interleaved1F1B}) {
                const int v = min_stages_per_worker(schedule);
                if (!pipelining || std::none_of(c.schedules.begin(), c.schedules.end(),
                                                [v](Schedule x) { return min_stages_per_worker(x) == v; }))
                  continue;
                const auto& b = cut_for(schedule, s);
                const int n = static_cast<int>(c.workers) * v;
                if (static_cast<int>(b.size()) == n) cuts[n] = b;  // a --balance list is for one stage count only
              }
              // A B A B: every corpc schedule, then every pipelining schedule, --repeats times.
              for (long rep = 0; rep < c.repeats; ++rep) {
                for (auto schedule : c.schedules) {
                  const std::vector<int> balance = cut_for(schedule, s);
                  auto r = run_pipeline(c, schedule, s, balance, data);
                  out << "run " << static_cast<int>(schedule) << ' ' << s << ' ' << r.seconds << ' ' << r.bubble;
                  for (std::size_t w = 0; w < r.peak_bytes.size(); ++w)
                    out << ' ' << r.peak_bytes[w] << ' ' << r.held[w];
                  out << "\nusage " << static_cast<int>(schedule) << ' ' << s;
                  for (auto& u : r.usage) out << ' ' << u.cpu_seconds << ' ' << u.threads << ' ' << u.interop_threads;
                  out << '\n';
                  const StepAccount account = account_step(c, schedule, s, r.last);
                  out << "account " << static_cast<int>(schedule) << ' ' << s << ' ' << account.span << ' '
                      << account.replay << '\n';
                  if (rep == 0) {  // the step predicted for the cut: by the calibrated profile that chose it
                    const std::string key = std::string(to_string(schedule)) + "@" + std::to_string(s);
                    out << "cut " << static_cast<int>(schedule) << ' ' << s << ' ' << to_string(balance) << ' '
                        << (by_schedule ? simulated[key].first
                                        : simulated_step_seconds(schedule, static_cast<int>(c.workers),
                                                                 min_stages_per_worker(schedule), static_cast<int>(s),
                                                                 layer_costs(c, s), balance, c.send_seconds))
                        << '\n';
                  }
                  if (rep + 1 < c.repeats) continue;
                  const std::string label = std::string(to_string(schedule)) + " M=" + std::to_string(s);
                  std::int64_t origin = INT64_MAX;
                  for (auto& w : r.last)
                    for (auto& rec : w.records) origin = std::min(origin, rec.start_ns);
                  trace.add_step(process++, label, r.last, origin);
                  if (s == c.splits.back()) gantt.emplace_back(label, r.last);
                }
                if (pipelining) run_pipelining(c, s, cuts, false, out);
                out.flush();
              }
              if (compare) out << "pytorch " << s << ' ' << run_pytorch(c, s, script) << '\n';
            }
            // The one-process references alternately too: C++ (corpc's libtorch), then Python (pipelining's).
            for (long rep = 0; rep < c.repeats; ++rep) {
              Usage u;
              const double seconds = run_single_process(c, data, u);
              out << "single " << seconds << ' ' << u.cpu_seconds << ' ' << u.threads << ' ' << u.interop_threads
                  << '\n';
              if (pipelining) run_pipelining(c, 0, {}, true, out);
              out.flush();
            }
            out << "balance";
            for (auto& [n, b] : balances) {
              out << ' ' << n << ':';
              for (std::size_t i = 0; i < b.size(); ++i) out << (i ? "," : "") << b[i];
              if (simulated.count(n))  // seconds per step: this cut's against the slowest-stage cut's
                out << '(' << std::fixed << std::setprecision(3) << simulated[n].first << '/' << simulated[n].second
                    << std::defaultfloat << ')';
            }
            out << '\n';
            if (!trace_path.empty() && trace.write(trace_path))
              std::fprintf(stderr, "# wrote %s\n", trace_path.c_str());
            if (!gantt_path.empty()) write_gantt(gantt_path, gantt);
          }
          shutdown();
        },
        so);
  } catch (const std::exception& e) {  // a dead peer, a timeout: one line and a non-zero status, not std::terminate
    ::unlink(path);
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }

  // One (schedule, split) cell of corpc over its repeated runs.
  struct Row {
    int schedule = 0;
    long splits = 0;
    std::vector<double> seconds;                        // one per repeat
    double bubble = 0;                                  // summed over repeats (averaged when printed)
    std::vector<std::pair<std::int64_t, int>> workers;  // per worker: peak bytes and micro-batches held, over repeats
    std::vector<std::vector<Usage>> usage;              // per repeat, per worker
    std::string cut = "?";
    double simulated = NAN;            // the simulated step of that cut (seconds)
    std::vector<double> span, replay;  // per repeat, of its last step: see StepAccount
    double median() const { return bench::median(seconds); }
  };
  std::vector<Row> rows;
  auto row_of = [&rows](int schedule, long splits) -> Row& {
    for (auto& r : rows)
      if (r.schedule == schedule && r.splits == splits) return r;
    rows.push_back(Row{});
    rows.back().schedule = schedule, rows.back().splits = splits;
    return rows.back();
  };
  // The row a result line names: "KEY SCHEDULE SPLITS ...", read past SPLITS.
  auto read_row = [&row_of](std::istream& line) -> Row& {
    int schedule = 0;
    long splits = 0;
    line >> schedule >> splits;
    return row_of(schedule, splits);
  };
  std::map<long, double> torch_times;
  struct PipeliningRun {                  // one line of bench/pytorch_pipelining.py
    std::string schedule, result, check;  // result: seconds or FAILED:why; check: ok, NAN, WRONG-LOSS or -
    long splits = 0;
    double seconds = NAN;  // a finished run's time (valid or not)
    std::string detail;
    std::string cpu, threads;  // per rank, from its pipelining-usage line: "1.23/1.25", "1,1/1,1" (intra, inter-op)
  };
  std::vector<PipeliningRun> pipelining_runs;
  std::vector<std::string> pipelining_notes, pipelining_errors;
  std::vector<double> pipelining_single, single;  // one per repeat
  std::vector<Usage> pipelining_single_usage, single_usage;
  std::string balance_line;
  // "1.2,1.3" -> "1.2/1.3"
  auto slashes = [](std::string list) {
    std::replace(list.begin(), list.end(), ',', '/');
    return list;
  };
  {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::string key;
      ls >> key;
      if (key == "run") {
        Row& r = read_row(ls);
        double seconds, bubble;
        ls >> seconds >> bubble;
        r.seconds.push_back(seconds);
        r.bubble += bubble;
        std::int64_t bytes;
        int held;
        for (std::size_t w = 0; ls >> bytes >> held; ++w) {
          if (r.workers.size() <= w) r.workers.emplace_back(0, 0);
          r.workers[w] = {std::max(r.workers[w].first, bytes), std::max(r.workers[w].second, held)};
        }
      } else if (key == "usage") {
        Row& r = read_row(ls);
        std::vector<Usage> per_worker;
        for (Usage u; ls >> u.cpu_seconds >> u.threads >> u.interop_threads;) per_worker.push_back(u);
        r.usage.push_back(per_worker);
      } else if (key == "account") {
        Row& r = read_row(ls);
        double span, replay;
        ls >> span >> replay;
        r.span.push_back(span);
        r.replay.push_back(replay);
      } else if (key == "cut") {
        Row& r = read_row(ls);
        ls >> r.cut >> r.simulated;
      } else if (key == "pytorch") {
        long s;
        double t = NAN;
        ls >> s >> t;
        if (t > 0) torch_times[s] = t;  // a run that failed reports no time (Debian's 2.14 has no TensorPipe)
      } else if (key == "pipelining") {
        PipeliningRun r;
        std::string loss;
        ls >> r.schedule >> r.splits >> r.result >> loss >> r.check;
        if (r.result.rfind("FAILED", 0) != 0) r.seconds = std::stod(r.result);
        std::getline(ls, r.detail);
        if (auto hash = r.detail.find("# "); hash != std::string::npos) r.detail = r.detail.substr(hash + 2);
        pipelining_runs.push_back(r);
      } else if (key == "pipelining-usage") {  // follows its run's line
        std::string schedule, cpu, threads, interop;
        long splits;
        ls >> schedule >> splits >> cpu >> threads >> interop;
        if (!pipelining_runs.empty() && pipelining_runs.back().schedule == schedule) {
          pipelining_runs.back().cpu = slashes(cpu);
          std::istringstream ts(threads), is(interop);
          for (std::string t, i; std::getline(ts, t, ',') && std::getline(is, i, ',');)
            pipelining_runs.back().threads += (pipelining_runs.back().threads.empty() ? "" : "/") + t + "," + i;
        }
      } else if (key == "pipelining-reference") {
        double t;
        if (ls >> t) pipelining_single.push_back(t);
      } else if (key == "pipelining-reference-usage") {
        Usage u;
        ls >> u.cpu_seconds >> u.threads >> u.interop_threads;
        pipelining_single_usage.push_back(u);
      } else if (key == "pipelining-note" || key == "pipelining-error") {
        std::string text;
        std::getline(ls, text);
        auto& list = key == "pipelining-note" ? pipelining_notes : pipelining_errors;
        if (std::find(list.begin(), list.end(), text.substr(1)) == list.end()) list.push_back(text.substr(1));
      } else if (key == "single") {
        double t;
        Usage u;
        ls >> t >> u.cpu_seconds >> u.threads >> u.interop_threads;
        single.push_back(t);
        single_usage.push_back(u);
      } else if (key == "balance") {
        std::getline(ls, balance_line);
      }
    }
  }
  ::unlink(path);

  std::printf("# balance %s (%s):%s\n", c.balance.c_str(),
              c.balance == "schedule"
                  ? "schedule@splits:layers per stage, the cut kept after the rounds of real steps (its simulated "
                    "step/that of the cut minimizing the slowest stage, s, with the profile as calibrated)"
                  : "stages:layers per stage; V: cut for the V placement",
              balance_line.c_str());
  // A ratio or time that was not measured (no GPipe run at 1 split, PyTorch not compared) reads "-", not nan.
  auto cell = [](double v) {
    if (!std::isfinite(v)) return std::string("-");
    char text[32];
    std::snprintf(text, sizeof text, "%.2f", v);
    return std::string(text);
  };
  // The median and, with more than one run, the range: "2.61 (2.55-2.70)".
  auto spread = [&cell](const std::vector<double>& runs) {
    if (runs.empty()) return std::string("-");
    std::string text = cell(bench::median(runs));
    if (runs.size() > 1)
      text += " (" + cell(*std::min_element(runs.begin(), runs.end())) + "-" +
              cell(*std::max_element(runs.begin(), runs.end())) + ")";
    return text;
  };
  // Per worker, the median over repeats of its CPU seconds, and its threads (intra-op, inter-op) as the last run saw.
  auto usage_cells = [&cell](const std::vector<std::vector<Usage>>& runs) {
    std::string cpu, threads;
    for (std::size_t w = 0; !runs.empty() && w < runs.back().size(); ++w) {
      std::vector<double> seconds;
      for (auto& run : runs)
        if (w < run.size()) seconds.push_back(run[w].cpu_seconds);
      cpu += (w ? " / " : "") + cell(bench::median(seconds));
      threads += (w ? " / " : "") + std::to_string(runs.back()[w].threads) + "," +
                 std::to_string(runs.back()[w].interop_threads);
    }
    return std::make_pair(cpu.empty() ? "-" : cpu, threads.empty() ? "-" : threads);
  };
  double gpipe1 = NAN;
  for (auto& r : rows)
    if (r.schedule == static_cast<int>(Schedule::GPipe) && r.splits == 1) gpipe1 = r.median();
  std::printf("\n%ld run(s) per cell%s; times are the median (min-max) of the timed batches.\n", c.repeats,
              compare && !c.pipelining.empty() ? ", interleaved with pipelining's per split" : "");
  std::printf(
      "\n| schedule | splits | time (s) | cut | step simulated / measured (s) | actions' span / replayed (s) | "
      "GPipe@1 / this | bubble measured | "
      "bubble formula | peak activations per worker (MiB) | micro-batches held | CPU per worker (s) | threads "
      "(intra,inter-op) | PyTorch RPC (s) | PyTorch / corpc |\n");
  std::printf("|---|---:|---:|---|---:|---:|---:|---:|---:|---|---|---|---|---:|---:|\n");
  double best = INFINITY, best_torch = INFINITY;
  for (auto& r : rows) {
    const auto schedule = static_cast<Schedule>(r.schedule);
    const int v = min_stages_per_worker(schedule);
    std::string mem, held;
    for (auto& [b, h] : r.workers) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%.1f", mem.empty() ? "" : " / ", b / 1048576.0);
      mem += buf;
      held += (held.empty() ? "" : " / ") + std::to_string(h);
    }
    const double torch_s = torch_times.count(r.splits) ? torch_times[r.splits] : NAN;
    best = std::min(best, r.median());
    if (!std::isnan(torch_s)) best_torch = std::min(best_torch, torch_s);
    const auto [cpu, threads_used] = usage_cells(r.usage);
    std::printf("| %s | %ld | %s | %s | %s / %s | %s / %s | %s | %.3f | %.3f | %s | %s | %s | %s | %s | %s |\n",
                to_string(schedule), r.splits, spread(r.seconds).c_str(), r.cut.c_str(), cell(r.simulated).c_str(),
                cell(r.median() / static_cast<double>(c.batches)).c_str(),
                cell(r.span.empty() ? NAN : bench::median(r.span)).c_str(),
                cell(r.replay.empty() ? NAN : bench::median(r.replay)).c_str(), cell(gpipe1 / r.median()).c_str(),
                r.bubble / static_cast<double>(std::max<std::size_t>(1, r.seconds.size())),
                bubble_formula(schedule, static_cast<int>(c.workers), v, static_cast<int>(r.splits)), mem.c_str(),
                held.c_str(), cpu.c_str(), threads_used.c_str(), cell(torch_s).c_str(),
                cell(torch_s / r.median()).c_str());
  }
  const double images = static_cast<double>(c.batch * c.batches);
  const double single_s = single.empty() ? NAN : bench::median(single);
  // One process's runs as usage_cells takes them: each run with one "worker".
  auto one_process = [](const std::vector<Usage>& runs) {
    std::vector<std::vector<Usage>> out;
    for (auto& u : runs) out.push_back({u});
    return out;
  };
  const auto single_use = usage_cells(one_process(single_usage));
  std::printf(
      "\nOne process, no RPC, whole batches (%ld thread): %s s, %.1f images/s; CPU %s s, threads (intra,inter-op) %s\n",
      c.threads, spread(single).c_str(), images / single_s, single_use.first.c_str(), single_use.second.c_str());
  if (std::isfinite(best_torch))
    std::printf("Best corpc run (median): %.2f s = %.2fx PyTorch's best split (%.2f s), %.2fx one process\n", best,
                best / best_torch, best_torch, best / single_s);
  else
    std::printf("Best corpc run (median): %.2f s = %.2fx one process (%s)\n", best, best / single_s,
                compare ? "no run of PyTorch's RPC finished" : "PyTorch's RPC not compared: --compare-pytorch");
  std::printf(
      "Cut: layers per stage (--balance %s). Step simulated: the schedule's action lists run with each stage's F, I\n"
      "and W times profiled layer by layer at the split's micro-batch size (corpc/pipeline/schedule_balance.hpp),\n"
      "for --balance schedule as the rounds of real steps calibrated them before this cut ran (its prediction);\n"
      "measured: the median time over the timed batches. Actions' span: the last timed step's first action's start\n"
      "to its last action's end; replayed: the simulation run with each stage's actions taking what they took in\n"
      "that step. Span - replayed: waits that compute does not explain (messages, wake-ups); measured - span: the\n"
      "step's start and end (the master's calls, the optimizer step). Bubble measured: idle share of each worker\n"
      "between the step's first and last action (waits for inputs, messages, the step's start and end), averaged\n"
      "over workers, timed steps and runs. Peak activations: the CPU allocator's peak during a step above what was\n"
      "live at its start (parameters, gradients, optimizer state). CPU: each worker process's user + system time\n"
      "over the timed batches (getrusage), the median over runs.\n",
      c.balance.c_str());
  if (c.device != "cpu")
    std::printf(
        "On %s: the bubble is measured in host time (kernels are queued asynchronously) and the peak counts\n"
        "the CPU allocator only (device memory is not counted).\n",
        c.device.c_str());
  if (compare) {
    // torch.distributed.pipelining: each schedule's median time per split, then corpc's best median per split against
    // pipelining's best valid median (every run finished, and its every step's loss that of one process), the
    // tutorial's time and one process.
    const double pipelining_single_s = pipelining_single.empty() ? NAN : bench::median(pipelining_single);
    std::printf(
        "\ntorch.distributed.pipelining (bench/pytorch_pipelining.py), 2 ranks over Gloo, cut as corpc's 1F1B (2 "
        "stages) and Interleaved1F1B (4 stages) runs; time (s) per split, median (min-max) of %ld run(s) (PyTorch "
        "%s):\n",
        c.repeats, c.pipelining_torch.c_str());
    if (!c.pipelining_missing.empty()) std::printf("not run: %s\n", c.pipelining_missing.c_str());
    for (auto& n : pipelining_notes) std::printf("%s\n", n.c_str());
    std::vector<std::string> schedules;
    for (auto& r : pipelining_runs)
      if (std::find(schedules.begin(), schedules.end(), r.schedule) == schedules.end()) schedules.push_back(r.schedule);
    // A (schedule, split) cell's runs, and whether every one of them is valid.
    auto runs_of = [&](const std::string& name, long s) {
      std::vector<const PipeliningRun*> runs;
      for (auto& r : pipelining_runs)
        if (r.schedule == name && r.splits == s) runs.push_back(&r);
      return runs;
    };
    auto all_valid = [](const std::vector<const PipeliningRun*>& runs) {
      return !runs.empty() && std::all_of(runs.begin(), runs.end(), [](auto* r) { return r->check == "ok"; });
    };
    auto times = [](const std::vector<const PipeliningRun*>& runs) {
      std::vector<double> t;
      for (auto* r : runs)
        if (std::isfinite(r->seconds)) t.push_back(r->seconds);
      return t;
    };
    auto run_cell = [&](const std::vector<const PipeliningRun*>& runs) {
      if (runs.empty()) return std::string("-");
      if (all_valid(runs)) return spread(times(runs));
      const PipeliningRun& r = **std::find_if(runs.begin(), runs.end(), [](auto* x) { return x->check != "ok"; });
      std::string why = r.result == "FAILED:timeout"        ? "hang (timeout)"
                        : r.result.rfind("FAILED:", 0) == 0 ? r.result.substr(7)
                        : r.check == "NAN"                  ? "NaN loss"
                                                            : "wrong loss";
      const auto t = times(runs);
      return (t.empty() ? "" : spread(t) + ", ") + why;
    };
    if (!schedules.empty()) {
      for (int table = 0; table < 2; ++table) {
        if (table == 1)
          std::printf(
              "\nPipelining's CPU time per rank (s, over the timed batches, getrusage) and threads (intra,inter-op), "
              "last run:\n");
        std::printf("\n| schedule |");
        for (long s : c.splits) std::printf(" %ld |", s);
        std::printf("\n|---|");
        for (std::size_t i = 0; i < c.splits.size(); ++i) std::printf("---:|");
        std::printf("\n");
        for (auto& name : schedules) {
          std::printf("| %s |", name.c_str());
          for (long s : c.splits) {
            const auto runs = runs_of(name, s);
            if (table == 0) std::printf(" %s |", run_cell(runs).c_str());
            else if (runs.empty() || runs.back()->cpu.empty()) std::printf(" - |");
            else std::printf(" %s; %s |", runs.back()->cpu.c_str(), runs.back()->threads.c_str());
          }
          std::printf("\n");
        }
      }
      // Why each run that is not valid is not: one line per schedule and reason, the splits it happened at.
      std::vector<std::pair<std::string, std::vector<long>>> why;
      for (auto& r : pipelining_runs) {
        if (r.check == "ok") continue;
        const std::string text = r.schedule + ": " + (r.check == "-" ? "" : r.check + ": ") + r.detail;
        auto w = std::find_if(why.begin(), why.end(), [&](auto& x) { return x.first == text; });
        if (w == why.end()) why.emplace_back(text, std::vector<long>{r.splits});
        else if (std::find(w->second.begin(), w->second.end(), r.splits) == w->second.end())
          w->second.push_back(r.splits);
      }
      if (!why.empty()) std::printf("\n");
      for (auto& [text, splits] : why) {
        std::string list;
        for (long s : splits) list += (list.empty() ? "" : ",") + std::to_string(s);
        std::printf("- splits %s: %s\n", list.c_str(), text.c_str());
      }
    }
    for (auto& e : pipelining_errors) std::printf("- no result: %s\n", e.c_str());

    // Another build's corpc (--column: its --results), measured in its own run before this one.
    const OtherBuild other = read_other_build(flags.get("column", ""));
    std::printf(
        "\n| splits | corpc best (s) | corpc schedule | pipelining best valid (s) | pipelining schedule | PyTorch RPC "
        "tutorial (s) | corpc / pipelining | corpc / one process | pipelining / its one process |%s\n",
        other.label.empty() ? "" : (" corpc on libtorch " + other.label + " (s) | its / its one process |").c_str());
    std::printf("|---:|---:|---|---:|---|---:|---:|---:|---:|%s\n", other.label.empty() ? "" : "---:|---:|");
    std::string best_pipelining;  // schedule@splits
    double best_pipelining_s = INFINITY;
    for (long s : c.splits) {
      const Row* corpc_best = nullptr;
      for (auto& r : rows)
        if (r.splits == s && (!corpc_best || r.median() < corpc_best->median())) corpc_best = &r;
      if (!corpc_best) continue;
      std::string p;  // the schedule with the smallest median among those whose every run is valid
      double p_s = INFINITY;
      bool any = false;
      for (auto& name : schedules) {
        const auto runs = runs_of(name, s);
        any = any || !runs.empty();
        if (all_valid(runs) && bench::median(times(runs)) < p_s) p = name, p_s = bench::median(times(runs));
      }
      if (!p.empty() && p_s < best_pipelining_s)
        best_pipelining = p + ", " + std::to_string(s) + " splits", best_pipelining_s = p_s;
      const double torch_s = torch_times.count(s) ? torch_times[s] : NAN;
      const std::string which = !p.empty() ? p : any ? "none valid" : "not run (see above)";
      std::printf("| %ld | %s | %s | %s | %s | %s | %s | %s | %s |", s, spread(corpc_best->seconds).c_str(),
                  to_string(static_cast<Schedule>(corpc_best->schedule)),
                  p.empty() ? "-" : spread(times(runs_of(p, s))).c_str(), which.c_str(), cell(torch_s).c_str(),
                  cell(corpc_best->median() / p_s).c_str(), cell(corpc_best->median() / single_s).c_str(),
                  cell(p_s / pipelining_single_s).c_str());
      if (!other.label.empty()) {
        const double o = other.best.count(s) ? other.best.at(s) : NAN;
        std::printf(" %s | %s |", cell(o).c_str(), cell(o / other.single).c_str());
      }
      std::printf("\n");
    }
    std::printf("\nOne process, whole batches (%ld thread), median (min-max): libtorch %s (corpc's) %s s", c.threads,
                TORCH_VERSION, spread(single).c_str());
    if (!pipelining_single.empty()) {
      const auto use = usage_cells(one_process(pipelining_single_usage));
      std::printf("; PyTorch %s (the pipelining script's reference) %s s, CPU %s s, threads (intra,inter-op) %s",
                  c.pipelining_torch.c_str(), spread(pipelining_single).c_str(), use.first.c_str(), use.second.c_str());
    }
    if (!other.label.empty())
      std::printf("; libtorch %s (corpc's, its own run) %.2f s", other.label.c_str(), other.single);
    std::printf("\n");
    if (!other.label.empty())
      std::printf(
          "corpc on libtorch %s ran before this run, in its own build: compare it with its own one process, not\n"
          "across lines (kernels, BLAS and oneDNN differ between libtorch releases).\n",
          other.label.c_str());
    if (std::isfinite(best_pipelining_s))
      std::printf("Best pipelining run (median): %.2f s (%s) = %sx its one process; best corpc run = %.2fx it\n",
                  best_pipelining_s, best_pipelining.c_str(), cell(best_pipelining_s / pipelining_single_s).c_str(),
                  best / best_pipelining_s);
    std::printf(
        "Pipelining's valid cells (the only ones its best is taken from): every run finished, and every step's loss\n"
        "equal (1e-4 relative) to the same model's trained in one process on the same micro-batches; the others show\n"
        "their time beside why they are not valid. Ratios are of medians.\n");
  }
  if (const std::string results = flags.get("results", ""); !results.empty()) write_results(results, rows, single_s);
  return rows.empty() ? 1 : 0;
}
