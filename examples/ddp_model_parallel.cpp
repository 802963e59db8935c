// The DDP notes' model-parallel program (demo_model_parallel): ToyMpModel spreads one model over two devices inside
// each process, and DDP averages its gradients across processes. This CPU build places both halves on the CPU; with
// CUDA, pass the process's two GPUs (e.g. cuda:2*rank and cuda:2*rank+1) and the code is unchanged.
//
//   ./build/examples/ddp_model_parallel                                        # 2 local ranks
//   torchrun --no_python --standalone --nproc_per_node=2 -r 1 -t 1 ./build/examples/ddp_model_parallel
#include <corpc/ddp/ddp.hpp>

#include "ddp_main.hpp"

namespace {

struct ToyMpModelImpl : torch::nn::Module {
  ToyMpModelImpl(torch::Device dev0, torch::Device dev1)
      : dev0(dev0),
        dev1(dev1),
        net1(register_module("net1", torch::nn::Linear(10, 10))),
        net2(register_module("net2", torch::nn::Linear(10, 5))) {
    net1->to(dev0);
    net2->to(dev1);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(net1->forward(x.to(dev0)));
    return net2->forward(x.to(dev1));
  }
  torch::Device dev0, dev1;
  torch::nn::Linear net1, net2;
};
TORCH_MODULE(ToyMpModel);

void demo_model_parallel() {
  auto group = corpc::ddp::init_process_group();
  const int rank = group->getRank();
  std::printf("Running DDP with model parallel example on rank %d.\n", rank);

  const torch::Device dev0(torch::kCPU), dev1(torch::kCPU);
  corpc::ddp::DistributedDataParallel ddp(ToyMpModel(dev0, dev1), group);  // buckets never mix devices
  torch::optim::SGD opt(ddp->parameters(), 0.001);

  opt.zero_grad();
  auto outputs = ddp.forward(torch::randn({20, 10}));  // outputs are on dev1
  auto loss = torch::mse_loss(outputs, torch::randn({20, 5}).to(dev1));
  loss.backward();
  opt.step();
  std::printf("rank %d: step done, loss %.4f\n", rank, loss.item<float>());
}

}  // namespace

int main() { return corpc::examples::ddp_main("ddp_model_parallel", 2, demo_model_parallel); }
