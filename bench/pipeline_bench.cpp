// The main job's benchmark: ResNet50 as a torch::nn::Sequential cut into pipeline stages on worker processes, trained
// (SGD, lr 0.05, MSE on one-hot labels) under each corpc::pipeline schedule and number of micro-batches, beside
// PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial on the same network and data, run interleaved, and
// beside torch.distributed.pipelining on the same job and balance, on the same libtorch where corpc is built against
// the PyTorch that runs it (scripts/benchmark.sh: both 2.14, in the Debian testing root).
//
//   pipeline_bench                          # batch 32 of 64x64 images, 3 timed batches, splits 1 2 4 8, 1 thread each
//   pipeline_bench --tutorial               # the tutorial's setting: batch 120 of 128x128 images
//   pipeline_bench --compare-pytorch        # after each split, the same split through torch.distributed.rpc (the
//                                           # tutorial) and through every schedule of torch.distributed.pipelining
//                                           # (bench/pytorch_pipelining.py), both run by --python (/usr/bin/python3)
//   pipeline_bench --compare-pytorch --pipelining-python 'CMD'   # CMD runs the pipelining script instead (an
//                                           # interpreter or a command prefix with torch >= 2.4); 'off' leaves it out
//   pipeline_bench --results FILE           # also writes corpc's best run per split and its one process to FILE
//   pipeline_bench --column FILE            # adds those of another build (its --results) as columns of the summary
//   pipeline_bench --schedules gpipe,1f1b,interleaved,zbh1 --balance measured|time|tutorial|11,12 --workers 2
//   pipeline_bench --trace pipeline_trace.json --gantt pipeline_gantt.png   # the last timed step of every run
//   pipeline_bench --device cuda:0          # every stage on that device (workers "workerN/cuda:0"), the reference too
//
// Prints, per schedule and split: the time of the timed batches, the bubble measured from the workers' timelines
// beside the schedule's formula, each worker's peak activation memory and micro-batches held, and PyTorch's time;
// with --compare-pytorch also each torch.distributed.pipelining schedule's time per split (or how it failed: a hang,
// an exception, a loss that is NaN or differs from the one-process loss) and, per split, corpc's best against
// pipelining's best, the tutorial's time, and one process.
//
// With --device cuda:N the workers share that GPU: activations and gradients go from stage to stage through device
// maps (cuda:N -> cuda:N between every two workers; the master sends only CPU inputs and targets), the balance is
// profiled on the device, and the timed batches end with a synchronize of every worker's device. Timelines (the
// bubble column) record host time, which on a GPU is when kernels were queued, not when they ran; the peak column
// counts the CPU allocator only. PyTorch's side gets --device too (bench/pytorch_pipeline.py: the tutorial's shards
// on the device, tensors crossing RPC on the CPU).
#include <sys/wait.h>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "../tools/gantt.hpp"
#include "bench_util.hpp"
#include "corpc/corpc.hpp"
#include "corpc/pipeline/pipeline.hpp"
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
};

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
// "measured" (balance-by-time refined by the stage times of real steps with the runs' placement), or a list.
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

struct RunResult {
  double seconds = 0, bubble = 0;
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
  return r;
}

// The same batches through the unsplit model in this process, no RPC, whole batches: the floor to beat. On the stages'
// device, the batches copied there inside the timed steps (as the pipeline's first stage does).
double run_single_process(const Config& c, const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
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
  auto t0 = Clock::now();
  for (auto& [x, y] : data) step(x, y);
  synchronize_device(c.device);
  return std::chrono::duration<double>(Clock::now() - t0).count();
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
// SPLITS SECONDS|FAILED:WHY LOSS CHECK # detail"), its one-process time as "pipelining-reference SECONDS" (asked for
// with the first split run only), its patch note as "pipelining-note TEXT", and a run that printed no result as
// "pipelining-error SPLITS TEXT".
void run_pipelining(const Config& c, long split, const std::map<int, std::vector<int>>& cuts, bool reference,
                    std::ostream& out) {
  if (cuts.empty()) {
    out << "pipelining-error " << split << " --balance " << c.balance << " cuts neither 2 nor 4 stages\n";
    return;
  }
  std::ostringstream cmd;
  cmd << c.pipelining << " " << c.pipelining_script << " --batch-size " << c.batch << " --image-size " << c.image
      << " --num-batches " << c.batches << " --threads " << c.threads << " --base-width " << c.width
      << " --num-classes " << c.classes << " --warmup " << c.warmup << " --timeout " << c.pipelining_timeout
      << " --splits " << split << " --balance";
  for (auto& [n, b] : cuts) cmd << ' ' << n << ':' << to_string(b);
  cmd << " --schedules " << (cuts.count(2) ? "GPipe,1F1B" : "") << (cuts.size() == 2 ? "," : "")
      << (cuts.count(4) ? "Interleaved1F1B,LoopedBFS,InterleavedZeroBubble,ZBVZeroBubble" : "");
  if (reference) cmd << " --reference-time";
  std::fprintf(stderr, "# running torch.distributed.pipelining: %s\n", cmd.str().c_str());
  bool any = false;
  auto [lines, status] = run_command(cmd.str(), [&](const std::string& l) {
    if (l.rfind("JSON: ", 0) == 0) return;
    std::fprintf(stderr, "  [pipelining] %s\n", l.c_str());
    if (l.rfind("pipelining ", 0) == 0) {
      out << l << '\n';
      any = true;
    } else if (l.rfind("reference ", 0) == 0) {
      out << "pipelining-reference " << l.substr(10) << '\n';
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
    if (!best.count(r.splits) || r.seconds < best[r.splits]) best[r.splits] = r.seconds;
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
        "measured|time|tutorial|N,N..]\n"
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
  c.balance = flags.get("balance", "measured");
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
      "balance: %s; host cache: %s\n",
      c.width, 4 + 16 + 3, c.workers, c.device.c_str(), c.batch, c.image, c.image, c.batches, c.warmup, c.threads,
      c.balance.c_str(), host_cache.c_str());
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
            std::map<std::string, std::vector<int>> balances;  // by balance_key
            ChromeTrace trace;
            std::vector<std::pair<std::string, std::vector<WorkerReport>>> gantt;
            int process = 0;
            bool pipelining_reference = false;  // its one-process time: asked for once, with the first split run
            for (long s : c.splits) {
              if (micro_batch_too_small(c, s)) {
                std::fprintf(
                    stderr, "  [%ld splits] skipped: a micro-batch this small leaves one value per BatchNorm channel\n",
                    s);
                continue;
              }
              for (auto schedule : c.schedules) {
                const int v = min_stages_per_worker(schedule);
                const int stages = static_cast<int>(c.workers) * v;
                const std::string key = balance_key(stages, placement_of(schedule));
                if (!balances.count(key)) balances[key] = make_balance(c, stages, placement_of(schedule), data);
                auto r = run_pipeline(c, schedule, s, balances[key], data);
                out << "run " << static_cast<int>(schedule) << ' ' << s << ' ' << r.seconds << ' ' << r.bubble;
                for (std::size_t w = 0; w < r.peak_bytes.size(); ++w) out << ' ' << r.peak_bytes[w] << ' ' << r.held[w];
                out << '\n';
                const std::string label = std::string(to_string(schedule)) + " M=" + std::to_string(s);
                std::int64_t origin = INT64_MAX;
                for (auto& w : r.last)
                  for (auto& rec : w.records) origin = std::min(origin, rec.start_ns);
                trace.add_step(process++, label, r.last, origin);
                if (s == c.splits.back()) gantt.emplace_back(label, r.last);
              }
              if (compare)
                out << "pytorch " << s << ' ' << run_pytorch(c, s, script) << '\n';  // interleaved with corpc
              if (compare && !c.pipelining.empty()) {
                std::map<int, std::vector<int>> cuts;  // its schedules cut as corpc's 2- and 4-stage runs were
                for (int n : {2, 4}) {
                  const std::string key = balance_key(n, Placement::loop);
                  if (!balances.count(key)) {
                    auto b = make_balance(c, n, Placement::loop, data);  // a --balance list is for one stage count only
                    if (static_cast<int>(b.size()) == n) balances[key] = std::move(b);
                  }
                  if (balances.count(key) && static_cast<int>(balances[key].size()) == n) cuts[n] = balances[key];
                }
                run_pipelining(c, s, cuts, !pipelining_reference, out);
                pipelining_reference = true;
              }
              out.flush();
            }
            out << "single " << run_single_process(c, data) << '\n';
            out << "balance";
            for (auto& [n, b] : balances) {
              out << ' ' << n << ':';
              for (std::size_t i = 0; i < b.size(); ++i) out << (i ? "," : "") << b[i];
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

  struct Row {
    int schedule;
    long splits;
    double seconds, bubble;
    std::vector<std::pair<std::int64_t, int>> workers;
  };
  std::vector<Row> rows;
  std::map<long, double> torch_times;
  struct PipeliningRun {                  // one line of bench/pytorch_pipelining.py
    std::string schedule, result, check;  // result: seconds or FAILED:why; check: ok, NAN, WRONG-LOSS or -
    long splits = 0;
    double seconds = NAN;  // a finished run's time (valid or not)
    std::string detail;
  };
  std::vector<PipeliningRun> pipelining_runs;
  std::vector<std::string> pipelining_notes, pipelining_errors;
  double pipelining_single = NAN;
  double single = NAN;
  std::string balance_line;
  {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::string key;
      ls >> key;
      if (key == "run") {
        Row r;
        ls >> r.schedule >> r.splits >> r.seconds >> r.bubble;
        std::int64_t bytes;
        int held;
        while (ls >> bytes >> held) r.workers.emplace_back(bytes, held);
        rows.push_back(r);
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
      } else if (key == "pipelining-reference") {
        ls >> pipelining_single;
      } else if (key == "pipelining-note" || key == "pipelining-error") {
        std::string text;
        std::getline(ls, text);
        auto& list = key == "pipelining-note" ? pipelining_notes : pipelining_errors;
        if (std::find(list.begin(), list.end(), text.substr(1)) == list.end()) list.push_back(text.substr(1));
      } else if (key == "single") {
        ls >> single;
      } else if (key == "balance") {
        std::getline(ls, balance_line);
      }
    }
  }
  ::unlink(path);

  std::printf("# balance (stages:layers per stage; V: cut for the V placement):%s\n", balance_line.c_str());
  double gpipe1 = NAN;
  for (auto& r : rows)
    if (r.schedule == static_cast<int>(Schedule::GPipe) && r.splits == 1) gpipe1 = r.seconds;
  std::printf(
      "\n| schedule | splits | time (s) | GPipe@1 / this | bubble measured | bubble formula | peak activations per "
      "worker (MiB) | micro-batches held | PyTorch RPC (s) | PyTorch / corpc |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---|---|---:|---:|\n");
  double best = INFINITY, best_torch = INFINITY;
  // A ratio or time that was not measured (no GPipe run at 1 split, PyTorch not compared) reads "-", not nan.
  auto cell = [](double v) {
    if (!std::isfinite(v)) return std::string("-");
    char text[32];
    std::snprintf(text, sizeof text, "%.2f", v);
    return std::string(text);
  };
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
    best = std::min(best, r.seconds);
    if (!std::isnan(torch_s)) best_torch = std::min(best_torch, torch_s);
    std::printf("| %s | %ld | %.2f | %s | %.3f | %.3f | %s | %s | %s | %s |\n", to_string(schedule), r.splits,
                r.seconds, cell(gpipe1 / r.seconds).c_str(), r.bubble,
                bubble_formula(schedule, static_cast<int>(c.workers), v, static_cast<int>(r.splits)), mem.c_str(),
                held.c_str(), cell(torch_s).c_str(), cell(torch_s / r.seconds).c_str());
  }
  const double images = static_cast<double>(c.batch * c.batches);
  std::printf("\nOne process, no RPC, whole batches (%ld thread): %.2f s, %.1f images/s\n", c.threads, single,
              images / single);
  if (std::isfinite(best_torch))
    std::printf("Best corpc run: %.2f s = %.2fx PyTorch's best split (%.2f s), %.2fx one process\n", best,
                best / best_torch, best_torch, best / single);
  else
    std::printf("Best corpc run: %.2f s = %.2fx one process (%s)\n", best, best / single,
                compare ? "no run of PyTorch's RPC finished" : "PyTorch's RPC not compared: --compare-pytorch");
  std::printf(
      "Bubble measured: idle share of each worker between the step's first and last action (waits for inputs,\n"
      "messages, the step's start and end), averaged over workers and timed steps. Peak activations: the CPU\n"
      "allocator's peak during a step above what was live at its start (parameters, gradients, optimizer state).\n");
  if (c.device != "cpu")
    std::printf(
        "On %s: the bubble is measured in host time (kernels are queued asynchronously) and the peak counts\n"
        "the CPU allocator only (device memory is not counted).\n",
        c.device.c_str());
  if (compare) {
    // torch.distributed.pipelining: each schedule's time per split, then corpc's best per split
    // against pipelining's best valid run (finished, and its every step's loss that of one process), the tutorial's
    // time and one process.
    std::printf(
        "\ntorch.distributed.pipelining (bench/pytorch_pipelining.py), 2 ranks over Gloo, cut as corpc's runs; "
        "time (s) per split (PyTorch %s):\n",
        c.pipelining_torch.c_str());
    if (!c.pipelining_missing.empty()) std::printf("not run: %s\n", c.pipelining_missing.c_str());
    for (auto& n : pipelining_notes) std::printf("%s\n", n.c_str());
    std::vector<std::string> schedules;
    for (auto& r : pipelining_runs)
      if (std::find(schedules.begin(), schedules.end(), r.schedule) == schedules.end()) schedules.push_back(r.schedule);
    auto run_cell = [](const PipeliningRun& r) {
      char buf[64];
      if (r.check == "ok") std::snprintf(buf, sizeof buf, "%.2f", r.seconds);
      else if (r.result == "FAILED:timeout") std::snprintf(buf, sizeof buf, "hang (timeout)");
      else if (r.result.rfind("FAILED:", 0) == 0) std::snprintf(buf, sizeof buf, "%s", r.result.substr(7).c_str());
      else std::snprintf(buf, sizeof buf, "%.2f, %s", r.seconds, r.check == "NAN" ? "NaN loss" : "wrong loss");
      return std::string(buf);
    };
    if (!schedules.empty()) {
      std::printf("\n| schedule |");
      for (long s : c.splits) std::printf(" %ld |", s);
      std::printf("\n|---|");
      for (std::size_t i = 0; i < c.splits.size(); ++i) std::printf("---:|");
      std::printf("\n");
      for (auto& name : schedules) {
        std::printf("| %s |", name.c_str());
        for (long s : c.splits) {
          auto r = std::find_if(pipelining_runs.begin(), pipelining_runs.end(),
                                [&](const PipeliningRun& x) { return x.schedule == name && x.splits == s; });
          std::printf(" %s |", r == pipelining_runs.end() ? "-" : run_cell(*r).c_str());
        }
        std::printf("\n");
      }
      // Why each run that is not valid is not: one line per schedule and reason, the splits it happened at.
      std::vector<std::pair<std::string, std::vector<long>>> why;
      for (auto& r : pipelining_runs) {
        if (r.check == "ok") continue;
        const std::string text = r.schedule + ": " + (r.check == "-" ? "" : r.check + ": ") + r.detail;
        auto w = std::find_if(why.begin(), why.end(), [&](auto& x) { return x.first == text; });
        if (w == why.end()) why.emplace_back(text, std::vector<long>{r.splits});
        else w->second.push_back(r.splits);
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
        "\n| splits | corpc best (s) | corpc schedule | pipelining best (s) | pipelining schedule | PyTorch RPC "
        "tutorial (s) | corpc / pipelining | corpc / one process | pipelining / its one process |%s\n",
        other.label.empty() ? "" : (" corpc on libtorch " + other.label + " (s) | its / its one process |").c_str());
    std::printf("|---:|---:|---|---:|---|---:|---:|---:|---:|%s\n", other.label.empty() ? "" : "---:|---:|");
    const PipeliningRun* best_pipelining = nullptr;
    for (long s : c.splits) {
      const Row* corpc_best = nullptr;
      for (auto& r : rows)
        if (r.splits == s && (!corpc_best || r.seconds < corpc_best->seconds)) corpc_best = &r;
      if (!corpc_best) continue;
      const PipeliningRun* p = nullptr;
      bool any = false;
      for (auto& r : pipelining_runs)
        if (r.splits == s) {
          any = true;
          if (r.check == "ok" && (!p || r.seconds < p->seconds)) p = &r;
        }
      if (p && (!best_pipelining || p->seconds < best_pipelining->seconds)) best_pipelining = p;
      const double torch_s = torch_times.count(s) ? torch_times[s] : NAN;
      char pt[32] = "-";
      if (p) std::snprintf(pt, sizeof pt, "%.2f", p->seconds);
      const std::string which = p ? p->schedule : any ? "none valid" : "not run (see above)";
      std::printf("| %ld | %.2f | %s | %s | %s | %s | %s | %s | %s |", s, corpc_best->seconds,
                  to_string(static_cast<Schedule>(corpc_best->schedule)), pt, which.c_str(), cell(torch_s).c_str(),
                  cell(p ? corpc_best->seconds / p->seconds : NAN).c_str(), cell(corpc_best->seconds / single).c_str(),
                  cell(p ? p->seconds / pipelining_single : NAN).c_str());
      if (!other.label.empty()) {
        const double o = other.best.count(s) ? other.best.at(s) : NAN;
        std::printf(" %s | %s |", cell(o).c_str(), cell(o / other.single).c_str());
      }
      std::printf("\n");
    }
    std::printf("\nOne process, whole batches (%ld thread): libtorch %s (corpc's) %.2f s", c.threads, TORCH_VERSION,
                single);
    if (!std::isnan(pipelining_single))
      std::printf("; PyTorch %s (the pipelining script's reference) %.2f s", c.pipelining_torch.c_str(),
                  pipelining_single);
    if (!other.label.empty())
      std::printf("; libtorch %s (corpc's, its own run) %.2f s", other.label.c_str(), other.single);
    std::printf("\n");
    if (!other.label.empty())
      std::printf(
          "corpc on libtorch %s ran before this run, in its own build: compare it with its own one process, not\n"
          "across lines (kernels, BLAS and oneDNN differ between libtorch releases).\n",
          other.label.c_str());
    if (best_pipelining)
      std::printf("Best pipelining run: %.2f s (%s, %ld splits) = %.2fx its one process; best corpc run = %.2fx it\n",
                  best_pipelining->seconds, best_pipelining->schedule.c_str(), best_pipelining->splits,
                  best_pipelining->seconds / pipelining_single, best / best_pipelining->seconds);
    std::printf(
        "Pipelining's valid runs (the only ones its best is taken from): finished, and every step's loss equal\n"
        "(1e-4 relative) to the same model's trained in one process on the same micro-batches; the others show their\n"
        "time beside why they are not valid.\n");
  }
  if (const std::string results = flags.get("results", ""); !results.empty()) write_results(results, rows, single);
  return rows.empty() ? 1 : 0;
}
