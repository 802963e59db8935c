// The DDP notes' checkpoint program (demo_checkpoint): rank 0 saves the model, every rank waits at a barrier, then
// all load it (mapping the tensors onto their device) and train on.
//
//   ./build/examples/ddp_checkpoint                                            # 2 local ranks
//   torchrun --no_python --standalone --nproc_per_node=2 -r 1 -t 1 ./build/examples/ddp_checkpoint
#include <corpc/ddp/checkpoint.hpp>
#include <corpc/ddp/ddp.hpp>

#include <cstdio>
#include <filesystem>

#include "ddp_main.hpp"

namespace {

void demo_checkpoint() {
  auto group = corpc::ddp::init_process_group();
  const int rank = group->getRank();
  std::printf("Running DDP checkpoint example on rank %d.\n", rank);

  auto model = torch::nn::Sequential(torch::nn::Linear(10, 10), torch::nn::ReLU(), torch::nn::Linear(10, 5));
  corpc::ddp::DistributedDataParallel ddp(model, group);
  torch::optim::SGD opt(ddp->parameters(), 0.001);

  // All ranks hold the same weights (DDP broadcast rank 0's), so one writer is enough; the barrier inside keeps the
  // others from reading a file that is still being written. Then every rank loads it onto its own device (CPU here).
  const auto path = (std::filesystem::temp_directory_path() / "corpc_ddp_checkpoint_example.pt").string();
  corpc::ddp::save_and_reload(*ddp.module(), &opt, path, *group, torch::Device(torch::kCPU));

  opt.zero_grad();
  auto loss = torch::mse_loss(ddp.forward(torch::randn({20, 10})), torch::randn({20, 5}));
  loss.backward();
  opt.step();

  group->barrier()->wait();  // nobody reads the file any more
  if (rank == 0) std::filesystem::remove(path);
  std::printf("rank %d: trained one step from the checkpoint, loss %.4f\n", rank, loss.item<float>());
}

}  // namespace

int main() { return corpc::examples::ddp_main("ddp_checkpoint", 2, demo_checkpoint); }
