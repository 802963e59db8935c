// The two benchmark models, built identically in bench/pytorch_ddp_bench.py.
#pragma once

#include <torch/torch.h>

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

}  // namespace corpc::bench
