// The benchmark models, built identically in bench/pytorch_ddp_bench.py (each side prints its parameter count).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace corpc::bench {

// Communication-heavy: 4 x Linear(1024, 1024) (16 MiB of float32 gradients for little compute).
inline torch::nn::Sequential big_linear() {
  torch::nn::Sequential s;
  for (int i = 0; i < 4; ++i) {
    s->push_back(torch::nn::Linear(1024, 1024));
    if (i < 3) s->push_back(torch::nn::ReLU());
  }
  return s;
}

// Compute-heavier: a small convolutional net on 3x32x32 images (~1.2 M parameters).
inline torch::nn::Sequential small_cnn() {
  namespace nn = torch::nn;
  return nn::Sequential(nn::Conv2d(nn::Conv2dOptions(3, 64, 3).padding(1)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(64, 128, 3).padding(1).stride(2)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(128, 256, 3).padding(1).stride(2)), nn::ReLU(),
                        nn::Conv2d(nn::Conv2dOptions(256, 256, 3).padding(1).stride(2)), nn::ReLU(),
                        nn::AdaptiveAvgPool2d(1), nn::Flatten(), nn::Linear(256, 10));
}

// torchvision's ResNet-18 (BasicBlocks [2, 2, 2, 2], 1000 classes: 11,689,512 parameters, 45 MiB of float32
// gradients), written out so that both sides build it without torchvision.
class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t in, int64_t out, int64_t stride) {
    namespace nn = torch::nn;
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(out));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      downsample = register_module(
          "downsample",
          nn::Sequential(nn::Conv2d(nn::Conv2dOptions(in, out, 1).stride(stride).bias(false)), nn::BatchNorm2d(out)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    return torch::relu(y + (downsample ? downsample->forward(x) : x));
  }

 private:
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};
};
TORCH_MODULE(BasicBlock);

inline torch::nn::Sequential resnet18(int64_t classes = 1000) {
  namespace nn = torch::nn;
  nn::Sequential s(nn::Conv2d(nn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)), nn::BatchNorm2d(64),
                   nn::ReLU(), nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  int64_t in = 64;
  for (int64_t width : {64, 128, 256, 512}) {
    const int64_t stride = width == 64 ? 1 : 2;
    s->push_back(BasicBlock(in, width, stride));
    s->push_back(BasicBlock(width, width, 1));
    in = width;
  }
  s->push_back(nn::AdaptiveAvgPool2d(1));
  s->push_back(nn::Flatten());
  s->push_back(nn::Linear(512, classes));
  return s;
}

inline int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace corpc::bench
