// DDP training steps/s on 2 local ranks (1 intra-op thread each), one configuration per run:
//
//   ddp_bench <linear|cnn|resnet18> <overlap|after> [steps] [--phases]
//
// overlap: corpc::ddp::DistributedDataParallel (bucketed allreduce during backward).
// after:   the same model, one coalesced allreduce of all gradients after backward (no overlap), with the same
//          memory traffic as DDP's buckets: one flat buffer made once, gradients divided on their way in, copied back.
// Prints "# params <model> <count>" and "corpc-<mode> <model> <steps/s>"; bench/compare_ddp.sh interleaves it with
// PyTorch's DDP. --phases: each rank also prints its mean milliseconds per step in forward, backward (for overlap:
// including the end-of-backward wait for the last buckets), allreduce (after) and optimizer step, and the CPU time
// the whole process (every thread: Gloo's too) spent per step, which the machine's load changes far less than wall time.
#include <corpc/ddp/ddp.hpp>
#include <corpc/rpc/launch.hpp>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench_util.hpp"
#include "ddp_models.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// Per-rank batch sizes: the same in bench/pytorch_ddp_bench.py.
std::pair<torch::Tensor, torch::Tensor> data(const std::string& model, int rank) {
  torch::manual_seed(rank);
  if (model == "linear") return {torch::randn({32, 1024}), torch::randn({32, 1024})};
  if (model == "resnet18") return {torch::randn({16, 3, 32, 32}), torch::randint(0, 1000, {16})};
  return {torch::randn({16, 3, 32, 32}), torch::randint(0, 10, {16})};
}

torch::nn::Sequential make_model(const std::string& model) {
  if (model == "linear") return corpc::bench::big_linear();
  if (model == "resnet18") return corpc::bench::resnet18();
  if (model == "cnn") return corpc::bench::small_cnn();
  throw std::invalid_argument("unknown model " + model);
}

torch::Tensor loss_of(const std::string& model, const torch::Tensor& out, const torch::Tensor& y) {
  return model == "linear" ? torch::mse_loss(out, y) : torch::cross_entropy_loss(out, y);
}

double process_cpu_ms() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
}

// Milliseconds spent in each phase over the timed steps.
struct Phases {
  double forward = 0, backward = 0, allreduce = 0, step = 0, cpu = 0;
  Clock::time_point t = Clock::now();
  bool on = false;
  void mark(double& into) {
    const auto now = Clock::now();
    if (on) into += std::chrono::duration<double, std::milli>(now - t).count();
    t = now;
  }
};

void run(const std::string& model, const std::string& mode, int steps, bool print_phases, int rank) {
  at::set_num_threads(1);
  corpc::bench::set_blas_threads(1);
  auto group = corpc::ddp::init_process_group();
  auto net = make_model(model);
  auto [x, y] = data(model, rank);
  const int warmup = 3;
  Clock::time_point start;
  Phases ph;
  auto begin_step = [&](int i) {
    if (i == warmup) {
      start = Clock::now();
      ph.on = true;
      ph.cpu = -process_cpu_ms();
    }
    ph.mark(ph.step);  // not counted: the loop's bookkeeping is negligible
  };

  if (mode == "overlap") {
    corpc::ddp::DistributedDataParallel ddp(net, group);
    torch::optim::SGD opt(ddp->parameters(), 0.01);
    for (int i = 0; i < warmup + steps; ++i) {
      begin_step(i);
      opt.zero_grad();
      auto loss = loss_of(model, ddp.forward(x), y);
      ph.mark(ph.forward);
      loss.backward();
      ph.mark(ph.backward);
      opt.step();
      ph.mark(ph.step);
    }
  } else {
    torch::optim::SGD opt(net->parameters(), 0.01);
    auto params = net->parameters();
    // Made once, as DDP's buckets are: a buffer allocated per step (45 MiB for ResNet-18, above glibc's mmap
    // threshold) would cost page faults every step and make this baseline slower than it need be.
    std::vector<at::Tensor> flat{torch::empty({corpc::bench::parameter_count(*net)})};
    const auto scale = torch::scalar_tensor(1.0 / group->getSize(), torch::kDouble);
    for (int i = 0; i < warmup + steps; ++i) {
      begin_step(i);
      opt.zero_grad();
      auto loss = loss_of(model, net->forward(x), y);
      ph.mark(ph.forward);
      loss.backward();
      ph.mark(ph.backward);
      torch::NoGradGuard no_grad;
      int64_t off = 0;
      for (auto& p : params) {
        auto part = flat[0].narrow(0, off, p.numel());
        torch::mul_out(part, p.grad().view(-1), scale);
        off += p.numel();
      }
      group->allreduce(flat)->wait();
      off = 0;
      for (auto& p : params) {
        p.mutable_grad().copy_(flat[0].narrow(0, off, p.numel()).view(p.sizes()));
        off += p.numel();
      }
      ph.mark(ph.allreduce);
      opt.step();
      ph.mark(ph.step);
    }
  }
  std::vector<at::Tensor> done{torch::zeros({1})};
  group->allreduce(done)->wait();  // both ranks finished
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  ph.cpu += process_cpu_ms();
  if (rank == 0) {
    std::printf("# params %s %lld\n", model.c_str(), static_cast<long long>(corpc::bench::parameter_count(*net)));
    std::printf("# threads corpc: intra-op %d, OpenBLAS %d\n", at::get_num_threads(), corpc::bench::blas_threads());
    std::printf("corpc-%s %s %.3f\n", mode.c_str(), model.c_str(), steps / secs);
    std::fflush(stdout);
  }
  if (print_phases) {
    std::fprintf(stderr,
                 "# rank %d corpc-%s %s ms/step: forward %.1f backward %.1f allreduce %.1f step %.1f cpu %.1f\n", rank,
                 mode.c_str(), model.c_str(), ph.forward / steps, ph.backward / steps, ph.allreduce / steps,
                 ph.step / steps, ph.cpu / steps);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: ddp_bench <linear|cnn|resnet18> <overlap|after> [steps] [--phases]\n");
    return 2;
  }
  const std::string model = argv[1], mode = argv[2];
  const int steps = argc > 3 && argv[3][0] != '-' ? std::atoi(argv[3]) : 20;
  const bool phases = corpc::bench::Flags(argc, argv).has("phases");
  try {
    corpc::LaunchOptions fork_ranks;
    fork_ranks.start = corpc::StartMethod::fork;  // the ranks share the parsed options; no thread has started here
    corpc::launch_processes(
        2, [&](int rank) { run(model, mode, steps, phases, rank); }, fork_ranks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
