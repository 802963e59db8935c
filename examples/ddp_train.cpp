// DistributedDataParallel from C++: each rank trains the same MLP on its share of a synthetic regression batch.
//
//   ./build/examples/ddp_train                                   # launches 2 local ranks itself
//   corpcrun -n 4 ./build/examples/ddp_train                     # or one rank per process of any launcher
//   srun -n 4 ./build/examples/ddp_train                         # (torchrun, corpcrun, srun, mpirun: launching.md)
//
// At the end every rank checks that its parameters equal rank 0's bit for bit, and rank 0 prints the loss.
#include <corpc/ddp/ddp.hpp>
#include <corpc/rpc/launch.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>

namespace {

void train(int steps) {
  auto group = corpc::ddp::init_process_group();
  const int rank = group->getRank();
  const int world = group->getSize();

  torch::manual_seed(rank);  // different on purpose: DDP starts every rank from rank 0's weights
  auto net = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::ReLU(), torch::nn::Linear(64, 1));
  corpc::ddp::DistributedDataParallel ddp(net, group);
  torch::optim::SGD opt(ddp->parameters(), 0.05);

  torch::manual_seed(1234);  // the same global batch everywhere; each rank takes its rows
  const int64_t global_batch = 64;
  auto x = torch::randn({global_batch, 16});
  auto y = x.sum(1, true).sin();
  const int64_t per_rank = global_batch / world;
  auto xs = x.narrow(0, rank * per_rank, per_rank);
  auto ys = y.narrow(0, rank * per_rank, per_rank);

  float loss_value = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(ddp.forward(xs), ys);
    loss.backward();  // gradients averaged across ranks here
    opt.step();
    loss_value = loss.item<float>();
  }

  for (auto& p : ddp->parameters()) {
    std::vector<at::Tensor> theirs{p.detach().clone()};
    group->broadcast(theirs)->wait();
    if (!torch::equal(theirs[0], p.detach())) {
      std::fprintf(stderr, "rank %d: parameters differ from rank 0's\n", rank);
      std::exit(1);
    }
  }
  if (rank == 0)
    std::printf("ddp_train: %d ranks, %d steps, rank 0 local loss %.5f, parameters identical\n", world, steps,
                loss_value);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  try {
    if (!corpc::launching_process() && !corpc::launched_rank()) {
      train(steps);  // one rank of a launcher's world (torchrun, corpcrun, srun, mpirun), of any size
    } else {
      corpc::launch_processes(2, [&](int) { train(steps); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train: %s\n", e.what());
    return 1;
  }
  return 0;
}
