// DDP training steps/s on 2 local ranks (1 intra-op thread each), one configuration per run:
//
//   ddp_bench <linear|cnn> <overlap|after> [steps]
//
// overlap: corpc::ddp::DistributedDataParallel (bucketed allreduce during backward).
// after:   the same model, one coalesced allreduce of all gradients after backward (no overlap).
// Prints one line "corpc-<mode> <model> <steps/s>"; bench/compare_ddp.sh interleaves it with PyTorch's DDP.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <corpc/ddp/ddp.hpp>
#include <corpc/rpc/launch.hpp>

#include "ddp_models.hpp"

namespace {

std::pair<torch::Tensor, torch::Tensor> data(const std::string& model, int rank) {
  torch::manual_seed(rank);
  if (model == "linear") return {torch::randn({32, 1024}), torch::randn({32, 1024})};
  return {torch::randn({16, 3, 32, 32}), torch::randint(0, 10, {16})};
}

torch::Tensor loss_of(const std::string& model, const torch::Tensor& out, const torch::Tensor& y) {
  return model == "linear" ? torch::mse_loss(out, y) : torch::cross_entropy_loss(out, y);
}

void run(const std::string& model, const std::string& mode, int steps, int rank) {
  at::set_num_threads(1);
  auto group = corpc::ddp::init_process_group();
  auto net = model == "linear" ? corpc::bench::big_linear() : corpc::bench::small_cnn();
  auto [x, y] = data(model, rank);
  const int warmup = 3;
  std::chrono::steady_clock::time_point start;

  if (mode == "overlap") {
    corpc::ddp::DistributedDataParallel ddp(net, group);
    torch::optim::SGD opt(ddp->parameters(), 0.01);
    for (int i = 0; i < warmup + steps; ++i) {
      if (i == warmup) start = std::chrono::steady_clock::now();
      opt.zero_grad();
      loss_of(model, ddp.forward(x), y).backward();
      opt.step();
    }
  } else {
    torch::optim::SGD opt(net->parameters(), 0.01);
    auto params = net->parameters();
    for (int i = 0; i < warmup + steps; ++i) {
      if (i == warmup) start = std::chrono::steady_clock::now();
      opt.zero_grad();
      loss_of(model, net->forward(x), y).backward();
      std::vector<at::Tensor> grads;
      for (auto& p : params) grads.push_back(p.grad().view(-1));
      std::vector<at::Tensor> flat{torch::cat(grads)};
      group->allreduce(flat)->wait();
      flat[0].div_(group->getSize());
      int64_t off = 0;
      for (auto& p : params) {
        p.mutable_grad().copy_(flat[0].narrow(0, off, p.numel()).view(p.sizes()));
        off += p.numel();
      }
      opt.step();
    }
  }
  std::vector<at::Tensor> done{torch::zeros({1})};
  group->allreduce(done)->wait();  // both ranks finished
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (rank == 0) std::printf("corpc-%s %s %.3f\n", mode.c_str(), model.c_str(), steps / secs);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: ddp_bench <linear|cnn> <overlap|after> [steps]\n");
    return 2;
  }
  const std::string model = argv[1], mode = argv[2];
  const int steps = argc > 3 ? std::atoi(argv[3]) : 20;
  try {
    corpc::launch_processes(2, [&](int rank) { run(model, mode, steps, rank); });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
