// Single-process model-parallel pipelining, after PyTorch's "Single-Machine
// Model Parallel Best Practices" tutorial: ResNet50 split into two shards,
// the batch split into micro-batches, and shard1 working on micro-batch i+1
// while shard2 works on micro-batch i.
//
// With two CUDA devices each shard gets its own GPU and the overlap comes
// from asynchronous kernel launches, as in the tutorial. On CPU nothing is
// asynchronous, so shard1 runs on a helper thread that hands activations to
// the main thread running shard2.
#include <torch/torch.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <future>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "../bench/bench_util.hpp"
#include "resnet/resnet_shards.hpp"

namespace {
using corpc::examples::ResNetConfig;
using corpc::examples::ResNetShard1;
using corpc::examples::ResNetShard2;

struct Args {
  std::vector<int64_t> splits{1, 2, 4, 8};
  int64_t batch_size = 32;
  int64_t image_size = 64;
  int64_t num_batches = 3;
  int64_t threads = 1;
  int64_t base_width = 64;
  int64_t num_classes = 1000;
};

[[noreturn]] void usage(const char* argv0, int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: %s [--splits 1,2,4,8] [--batch-size 32] "
               "[--image-size 64] [--num-batches 3] [--threads 1] "
               "[--base-width 64] [--num-classes 1000]\n",
               argv0);
  std::exit(rc);
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(std::stoll(item));
  return out;
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string key = argv[i];
    if (key == "-h" || key == "--help") usage(argv[0], 0);
    std::string val;
    if (auto eq = key.find('='); eq != std::string::npos) {
      val = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (i + 1 < argc) {
      val = argv[++i];
    } else {
      usage(argv[0], 2);
    }
    try {
      if (key == "--splits") a.splits = parse_list(val);
      else if (key == "--batch-size") a.batch_size = std::stoll(val);
      else if (key == "--image-size") a.image_size = std::stoll(val);
      else if (key == "--num-batches") a.num_batches = std::stoll(val);
      else if (key == "--threads") a.threads = std::stoll(val);
      else if (key == "--base-width") a.base_width = std::stoll(val);
      else if (key == "--num-classes") a.num_classes = std::stoll(val);
      else usage(argv[0], 2);
    } catch (const std::logic_error&) {
      usage(argv[0], 2);
    }
  }
  for (auto s : a.splits)
    if (s < 1 || s > a.batch_size) usage(argv[0], 2);
  if (a.splits.empty() || a.batch_size < 1 || a.num_batches < 1 || a.threads < 1 || a.base_width < 1) usage(argv[0], 2);
  return a;
}

// One-way handoff of activations between the two shard threads. A failure
// on the producer side is forwarded so the consumer cannot wait forever.
class Handoff {
 public:
  void push(torch::Tensor t) {
    std::lock_guard lk(mu_);
    items_.push_back(std::move(t));
    cv_.notify_one();
  }
  void fail(std::exception_ptr e) {
    std::lock_guard lk(mu_);
    error_ = e;
    cv_.notify_one();
  }
  torch::Tensor pop() {
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return !items_.empty() || error_; });
    if (items_.empty()) std::rethrow_exception(error_);
    auto t = std::move(items_.front());
    items_.pop_front();
    return t;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<torch::Tensor> items_;
  std::exception_ptr error_;
};

torch::Tensor pipelined_forward_cpu(ResNetShard1& s1, ResNetShard2& s2, const torch::Tensor& x, int64_t splits,
                                    int64_t threads) {
  auto chunks = x.chunk(splits);
  Handoff handoff;
  auto producer = std::async(std::launch::async, [&] {
    // OpenMP keeps the thread count per thread and kernels that bypass
    // at::parallel_for (oneDNN) read it directly, so a fresh thread could
    // use every core and fight the shard2 thread.
    at::set_num_threads(static_cast<int>(threads));
    try {
      for (auto& c : chunks) handoff.push(s1(c));
    } catch (...) {
      handoff.fail(std::current_exception());
    }
  });
  std::vector<torch::Tensor> outs;
  outs.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) outs.push_back(s2(handoff.pop()));
  producer.get();
  return torch::cat(outs);
}

// The tutorial's loop: kernels are queued on both GPUs without waiting, so
// shard1(next) on dev0 overlaps shard2(prev) on dev1.
torch::Tensor pipelined_forward_cuda(ResNetShard1& s1, ResNetShard2& s2, const torch::Tensor& x, int64_t splits,
                                     torch::Device dev1) {
  auto chunks = x.chunk(splits);
  std::vector<torch::Tensor> outs;
  auto prev = s1(chunks[0]).to(dev1);
  for (size_t i = 1; i < chunks.size(); ++i) {
    outs.push_back(s2(prev));
    prev = s1(chunks[i]).to(dev1);
  }
  outs.push_back(s2(prev));
  return torch::cat(outs);
}

// Training-mode BatchNorm needs more than one value per channel; layer4's
// output is image_size/32 pixels wide, so tiny micro-batches of tiny images
// cannot train. Returns the offending micro-batch size, or 0 if fine.
int64_t too_small_micro_batch(const Args& a, int64_t splits) {
  int64_t hw = a.image_size;
  for (int i = 0; i < 5; ++i) hw = (hw - 1) / 2 + 1;  // five stride-2 stages
  const int64_t chunk = (a.batch_size + splits - 1) / splits;
  const int64_t rest = a.batch_size % chunk;
  const int64_t smallest = rest ? rest : chunk;
  return smallest * hw * hw < 2 ? smallest : 0;
}

struct Result {
  double seconds;
  double final_loss;
};

Result train(const Args& a, int64_t splits, bool cuda) {
  const torch::Device dev0 = cuda ? torch::Device("cuda:0") : torch::kCPU;
  const torch::Device dev1 = cuda ? torch::Device("cuda:1") : torch::kCPU;

  // Same weights and data for every split count, so only scheduling differs.
  torch::manual_seed(0);
  ResNetConfig cfg;
  cfg.base_width = a.base_width;
  cfg.num_classes = a.num_classes;
  ResNetShard1 s1(cfg);
  ResNetShard2 s2(cfg);
  s1->to(dev0);
  s2->to(dev1);
  auto params = s1->parameters();
  for (auto& p : s2->parameters()) params.push_back(p);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));

  std::vector<torch::Tensor> images, labels;
  for (int64_t b = 0; b < a.num_batches; ++b) {
    images.push_back(corpc::examples::random_images(a.batch_size, a.image_size, 1000 + b).to(dev0));
    labels.push_back(corpc::examples::one_hot_labels(a.batch_size, a.num_classes, 2000 + b).to(dev1));
  }
  // Kernel launches return early; wait for both GPUs to bracket real work.
  auto sync = [&] {
    if (!cuda) return;
    torch::cuda::synchronize(0);
    torch::cuda::synchronize(1);
  };

  sync();
  const auto t0 = std::chrono::steady_clock::now();
  double loss_value = 0;
  for (int64_t b = 0; b < a.num_batches; ++b) {
    opt.zero_grad();
    auto out = cuda ? pipelined_forward_cuda(s1, s2, images[b], splits, dev1)
                    : pipelined_forward_cpu(s1, s2, images[b], splits, a.threads);
    auto loss = torch::mse_loss(out, labels[b]);
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
  }
  sync();
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  return {dt.count(), loss_value};
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  at::set_num_threads(static_cast<int>(a.threads));
  corpc::bench::set_blas_threads(static_cast<int>(a.threads));
  const bool cuda = torch::cuda::is_available() && torch::cuda::device_count() >= 2;

  std::printf(
      "single-process pipeline: %s, batch %lld, image %lld, "
      "base width %lld, %lld batches, %lld thread(s) per shard\n",
      cuda ? "cuda:0 + cuda:1" : "CPU (2 threads)", (long long)a.batch_size, (long long)a.image_size,
      (long long)a.base_width, (long long)a.num_batches, (long long)a.threads);
  std::printf("%6s %10s %8s %10s %10s\n", "splits", "seconds", "speedup", "images/s", "loss");

  double base = 0;
  for (auto splits : a.splits) {
    if (auto n = too_small_micro_batch(a, splits)) {
      std::printf(
          "%6lld skipped: a micro-batch of %lld image(s) of %lldpx "
          "leaves one value per BatchNorm channel in layer4\n",
          (long long)splits, (long long)n, (long long)a.image_size);
      continue;
    }
    const Result r = train(a, splits, cuda);
    if (splits == 1) base = r.seconds;
    char speedup[32] = "-";
    if (base > 0) std::snprintf(speedup, sizeof speedup, "%.2fx", base / r.seconds);
    std::printf("%6lld %10.3f %8s %10.1f %10.5f\n", (long long)splits, r.seconds, speedup,
                double(a.batch_size * a.num_batches) / r.seconds, r.final_loss);
    std::fflush(stdout);
  }
  return 0;
}
