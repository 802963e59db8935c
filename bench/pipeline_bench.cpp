// The split-size micro-benchmark of PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial, with corpc:
// ResNet50 cut in two shards on two worker processes, a master streaming micro-batches through them, trained with
// distributed autograd and DistributedOptimizer (SGD, lr 0.05, MSE on one-hot labels).
//
//   pipeline_bench                          # default: batch 32 of 64x64 images, 3 batches, splits 1 2 4 8, 1 thread
//   pipeline_bench --tutorial               # the tutorial's setting: batch 120 of 128x128 images, 3 batches
//   pipeline_bench --compare-pytorch        # then the same configuration through torch.distributed.rpc
//
// Prints a table per split: training-loop time (start-up and one warm-up batch excluded), speedup over 1 split,
// images/s and the GPipe ideal for 2 stages, plus the same batches trained in one process without RPC (the floor).
#include <torch/nn/functional/loss.h>
#include <torch/cuda.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "bench_util.hpp"
#include "corpc/corpc.hpp"
#include "corpc/pipeline/pipeline.hpp"
#include "resnet_shards.hpp"

using namespace corpc;
using namespace corpc::examples;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  std::vector<long> splits;
  long batch, image, batches, threads, width, classes, warmup;
  std::string device;
  bool one_f_one_b;
};

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::nn::functional::mse_loss(out, target); }

// Training-mode BatchNorm needs more than one value per channel; layer4's maps are image/32 wide.
bool micro_batch_too_small(const Config& c, long splits) {
  long hw = c.image;
  for (int i = 0; i < 5; ++i) hw = (hw - 1) / 2 + 1;
  long smallest = c.batch / splits;  // chunk() makes the last chunk the smallest
  if (c.batch % splits) smallest = c.batch - (splits - 1) * ((c.batch + splits - 1) / splits);
  return smallest * hw * hw < 2;
}

std::vector<std::pair<at::Tensor, at::Tensor>> make_data(const Config& c) {
  std::vector<std::pair<at::Tensor, at::Tensor>> data;
  for (long b = 0; b < c.batches; ++b)
    data.emplace_back(random_images(c.batch, c.image, 1000 + b), one_hot_labels(c.batch, c.classes, 2000 + b));
  return data;
}

const std::vector<std::int64_t> kResNet50Blocks{3, 4, 6, 3};

double run_split(const Config& c, long splits, const std::vector<std::pair<at::Tensor, at::Tensor>>& data) {
  auto s1 = pipeline::remote_stage<&make_shard1>("worker1/" + c.device, c.width, kResNet50Blocks, c.classes, std::uint64_t{0});
  // Two GPUs: one shard each, as in the tutorial; otherwise both shards on the given device.
  const std::string d2 = c.device.rfind("cuda", 0) == 0 && torch::cuda::device_count() >= 2 ? "cuda:1" : c.device;
  auto s2 = pipeline::remote_stage<&make_shard2>("worker2/" + d2, c.width, kResNet50Blocks, c.classes, std::uint64_t{1});
  pipeline::Pipeline pipe({s1, s2}, static_cast<int>(splits),
                          c.one_f_one_b ? pipeline::Schedule::OneFOneB : pipeline::Schedule::GPipe);
  DistributedOptimizer<torch::optim::SGD> opt(pipe.parameter_rrefs(), torch::optim::SGDOptions(0.05));
  for (long w = 0; w < c.warmup; ++w) sync_wait(pipe.train_step(data[0].first, data[0].second, mse, opt));
  auto t0 = Clock::now();
  for (long b = 0; b < c.batches; ++b) {
    auto tb = Clock::now();
    auto loss = sync_wait(pipe.train_step(data[b].first, data[b].second, mse, opt));
    std::fprintf(stderr, "  [%ld split%s] batch %ld/%ld: %.2f s, loss %.5f\n", splits, splits == 1 ? "" : "s", b + 1,
                 c.batches, std::chrono::duration<double>(Clock::now() - tb).count(), loss.item<double>());
  }
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The same batches through both shards in this process: no RPC, no pipelining. With `splits` > 1, each batch goes
// through as that many micro-batches one after another (gradients accumulated, one optimizer step): what the pipeline
// must beat for splitting to pay, since it pays the same per-micro-batch cost of small operators.
double run_single_process(const Config& c, const std::vector<std::pair<at::Tensor, at::Tensor>>& data, long splits = 1) {
  auto s1 = make_shard1(c.width, kResNet50Blocks, c.classes, 0);
  auto s2 = make_shard2(c.width, kResNet50Blocks, c.classes, 1);
  std::vector<at::Tensor> params;
  for (auto& p : s1->parameters()) params.push_back(p);
  for (auto& p : s2->parameters()) params.push_back(p);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  auto step = [&](const at::Tensor& x, const at::Tensor& y) {
    opt.zero_grad();
    double total = 0;
    auto xs = x.chunk(splits);
    auto ys = y.chunk(splits);
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double share = static_cast<double>(xs[i].size(0)) / static_cast<double>(x.size(0));
      auto loss = mse(s2->forward(s1->forward(xs[i])), ys[i]) * share;
      loss.backward();
      total += loss.item<double>();
    }
    opt.step();
    return total;
  };
  for (long w = 0; w < c.warmup; ++w) step(data[0].first, data[0].second);
  auto t0 = Clock::now();
  for (auto& [x, y] : data) step(x, y);
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs bench/pytorch_pipeline.py with the same configuration; returns split -> seconds (empty if unavailable).
std::map<long, double> run_pytorch(const Config& c, const std::string& script) {
  std::ostringstream cmd;
  cmd << "/usr/bin/python3 " << script << " --batch-size " << c.batch << " --image-size " << c.image
      << " --num-batches " << c.batches << " --threads " << c.threads << " --base-width " << c.width
      << " --num-classes " << c.classes << " --warmup " << c.warmup << " --splits";
  for (long s : c.splits) cmd << ' ' << s;
  cmd << " 2>/dev/null";
  std::fprintf(stderr, "# running PyTorch: %s\n", cmd.str().c_str());
  std::map<long, double> out;
  FILE* p = ::popen(cmd.str().c_str(), "r");
  if (!p) return out;
  char line[4096];
  while (std::fgets(line, sizeof line, p)) {
    std::string l(line);
    if (l.rfind("JSON: ", 0) != 0) {
      std::fprintf(stderr, "  [pytorch] %s", line);
      continue;
    }
    // {"splits": {"1": 5.2, "2": 4.5}}: pull out each "N": seconds pair.
    for (std::size_t pos = l.find('{', l.find("splits")); (pos = l.find('"', pos + 1)) != std::string::npos;) {
      auto end = l.find('"', pos + 1);
      long split = std::stol(l.substr(pos + 1, end - pos - 1));
      auto colon = l.find(':', end);
      out[split] = std::stod(l.substr(colon + 1));
      pos = l.find_first_of(",}", colon);
    }
  }
  ::pclose(p);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  bench::Flags flags(argc, argv);
  if (flags.has("help")) {
    std::puts("pipeline_bench [--splits 1,2,4,8] [--batch-size 32] [--image-size 64] [--num-batches 3] [--threads 1]\n"
              "               [--warmup 1] [--device auto|cpu|cuda:N] [--base-width 64] [--num-classes 1000] [--schedule gpipe|1f1b]\n"
              "               [--tutorial] [--compare-pytorch] [--pytorch-script bench/pytorch_pipeline.py]");
    return 0;
  }
  const bool tutorial = flags.has("tutorial");
  Config c{flags.get_list("splits", "1,2,4,8"),
           flags.get_int("batch-size", tutorial ? 120 : 32),
           flags.get_int("image-size", tutorial ? 128 : 64),
           flags.get_int("num-batches", 3),
           flags.get_int("threads", 1),
           flags.get_int("base-width", 64),
           flags.get_int("num-classes", 1000),
           flags.get_int("warmup", 1),
           flags.get("device", "auto"),
           flags.get("schedule", "gpipe") == "1f1b"};

  if (c.device == "auto") c.device = torch::cuda::is_available() ? "cuda:0" : "cpu";  // CUDA when build and machine have it
  bench::print_machine();
  std::printf("# ResNet50 (base width %ld) in 2 shards on 2 worker processes + master; batch %ld of %ldx%ld images, "
              "%ld timed batches after %ld warm-up, %ld intra-op thread(s) per process (OpenMP and OpenBLAS), device %s, schedule %s\n",
              c.width, c.batch, c.image, c.image, c.batches, c.warmup, c.threads, c.device.c_str(),
              c.one_f_one_b ? "1F1B" : "GPipe");
  std::fflush(stdout);

  // Results cross from the ranks to this process through a file (ranks are forked processes).
  char path[] = "/tmp/corpc_pipeline_bench_XXXXXX";
  int fd = ::mkstemp(path);
  ::close(fd);
  RpcOptions options;
  options.rpc_timeout = std::chrono::minutes(10);
  options.init_timeout = std::chrono::seconds(60);
  const int threads = static_cast<int>(c.threads);
  options.worker_thread_init = [threads] { at::set_num_threads(threads); };
  LaunchOptions so;
  so.timeout = std::chrono::minutes(60);
  try {
    launch_processes(3, [&](int rank) {
      at::set_num_threads(threads);
      bench::set_blas_threads(threads);
      init_rpc(rank == 0 ? "master" : "worker" + std::to_string(rank), rank, 3, options);
      if (rank == 0) {
        auto data = make_data(c);
        std::ofstream out(path);
        for (long s : c.splits) {
          if (micro_batch_too_small(c, s)) {
            std::fprintf(stderr, "  [%ld splits] skipped: a micro-batch this small leaves one value per BatchNorm channel\n", s);
            continue;
          }
          out << s << ' ' << run_split(c, s, data) << '\n';
          out << "seq" << s << ' ' << run_single_process(c, data, s) << '\n';  // right after, on the same machine state
          out.flush();
        }
        out << "single " << run_single_process(c, data) << '\n';
      }
      shutdown();
    }, so);
  } catch (const std::exception& e) {  // a dead peer, a timeout: one line and a non-zero status, not std::terminate
    ::unlink(path);
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }

  std::map<long, double> corpc_times, sequential;
  double single = NAN;
  {
    std::ifstream in(path);
    std::string key;
    double secs;
    while (in >> key >> secs) {
      if (key == "single") single = secs;
      else if (key.rfind("seq", 0) == 0) sequential[std::stol(key.substr(3))] = secs;
      else corpc_times[std::stol(key)] = secs;
    }
  }
  ::unlink(path);

  std::map<long, double> torch_times;
  if (flags.has("compare-pytorch")) torch_times = run_pytorch(c, flags.get("pytorch-script", "bench/pytorch_pipeline.py"));

  const double images = static_cast<double>(c.batch * c.batches);
  const double base = corpc_times.count(1) ? corpc_times[1] : NAN;
  std::printf("\n| splits | time (s) | speedup vs 1 split | images/s | GPipe ideal (2 stages) | 1 process, in sequence (s) | sequence / corpc |%s\n",
              torch_times.empty() ? "" : " PyTorch RPC (s) | PyTorch / corpc |");
  std::printf("|-------:|---------:|-------------------:|---------:|-----------------------:|---------------------------:|-----------------:|%s\n",
              torch_times.empty() ? "" : "----------------:|----------------:|");
  for (auto& [s, t] : corpc_times) {
    std::printf("| %6ld | %8.2f | %18.2f | %8.1f | %22.2f |", s, t, base / t, images / t, 2.0 * s / (s + 1.0));
    const double seq = sequential.count(s) ? sequential[s] : NAN;
    std::printf(" %26.2f | %16.2f |", seq, seq / t);
    if (!torch_times.empty()) {
      if (torch_times.count(s)) std::printf(" %15.2f | %15.2f |", torch_times[s], torch_times[s] / t);
      else std::printf(" %15s | %15s |", "-", "-");
    }
    std::printf("\n");
  }
  std::printf("\nOne process, no RPC (same batches, %ld thread): %.2f s, %.1f images/s\n", c.threads, single, images / single);
  std::printf("1 process, in sequence: the same micro-batches through both shards one after another in one process, no RPC,\n"
              "timed right after each split's run. sequence / corpc > 1: the pipeline beats running them in sequence.\n");
  return corpc_times.empty() ? 1 : 0;
}
