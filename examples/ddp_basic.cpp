// The DDP notes' first program (demo_basic): a toy model wrapped in DistributedDataParallel, one training step.
//
//   ./build/examples/ddp_basic                                                 # 2 local ranks
//   torchrun --no_python --standalone --nproc_per_node=2 -r 1 -t 1 ./build/examples/ddp_basic
#include <corpc/ddp/ddp.hpp>

#include "ddp_main.hpp"

namespace {

struct ToyModelImpl : torch::nn::Module {
  ToyModelImpl()
      : net1(register_module("net1", torch::nn::Linear(10, 10))),
        net2(register_module("net2", torch::nn::Linear(10, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return net2->forward(torch::relu(net1->forward(x))); }
  torch::nn::Linear net1, net2;
};
TORCH_MODULE(ToyModel);

void demo_basic() {
  auto group = corpc::ddp::init_process_group();
  const int rank = group->getRank();
  std::printf("Running basic DDP example on rank %d.\n", rank);

  corpc::ddp::DistributedDataParallel ddp(ToyModel(), group);
  torch::optim::SGD opt(ddp->parameters(), 0.001);

  opt.zero_grad();
  auto outputs = ddp.forward(torch::randn({20, 10}));
  auto labels = torch::randn({20, 5});
  torch::mse_loss(outputs, labels).backward();  // gradients averaged over the ranks here
  opt.step();
  std::printf("rank %d: step done, loss %.4f\n", rank, torch::mse_loss(outputs, labels).item<float>());
}

}  // namespace

int main() { return corpc::examples::ddp_main("ddp_basic", 2, demo_basic); }
