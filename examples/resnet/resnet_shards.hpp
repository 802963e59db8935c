// ResNet50 split into the two shards of PyTorch's "Distributed Pipeline
// Parallelism Using RPC" tutorial, written without torchvision so the C++
// and Python benchmarks run the same network.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/pooling.h>
#include <torch/nn/pimpl.h>

#include <array>
#include <cstdint>
#include <vector>

namespace corpc::examples {

// base_width scales every channel count (64 = real ResNet50) and blocks sets
// the Bottlenecks per layer, so tests can build a tiny but structurally
// identical network.
struct ResNetConfig {
  int64_t base_width = 64;
  std::array<int64_t, 4> blocks{3, 4, 6, 3};
  int64_t num_classes = 1000;
};

class BottleneckImpl : public torch::nn::Module {
 public:
  static constexpr int64_t kExpansion = 4;

  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride = 1);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  // Null unless the identity path must change shape.
  torch::nn::Conv2d downsample_conv{nullptr};
  torch::nn::BatchNorm2d downsample_bn{nullptr};
};
TORCH_MODULE(Bottleneck);

// conv1, bn1, relu, maxpool, layer1, layer2.
class ResNetShard1Impl : public torch::nn::Module {
 public:
  explicit ResNetShard1Impl(const ResNetConfig& cfg);
  explicit ResNetShard1Impl(int64_t base_width = 64);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::MaxPool2d maxpool{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr};
};
TORCH_MODULE(ResNetShard1);

// layer3, layer4, avgpool, flatten, fc.
class ResNetShard2Impl : public torch::nn::Module {
 public:
  explicit ResNetShard2Impl(const ResNetConfig& cfg);
  explicit ResNetShard2Impl(int64_t base_width = 64, int64_t num_classes = 1000);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Sequential layer3{nullptr}, layer4{nullptr};
  torch::nn::AdaptiveAvgPool2d avgpool{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ResNetShard2);

// Both shards in one module: the single-process reference.
class ResNet50Impl : public torch::nn::Module {
 public:
  explicit ResNet50Impl(const ResNetConfig& cfg = {});
  torch::Tensor forward(torch::Tensor x);

  ResNetShard1 shard1{nullptr};
  ResNetShard2 shard2{nullptr};
};
TORCH_MODULE(ResNet50);

// Seeded factories with plain arguments, so that a shard can be built on another worker (corpc::remote, or
// corpc::RemoteModule) with the same weights as a local reference built from the same seed.
// blocks: Bottlenecks per layer (4 entries).
ResNetShard1 make_shard1(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes, uint64_t seed);
ResNetShard2 make_shard2(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes, uint64_t seed);
// The same network as one torch::nn::Sequential of 4 + sum(blocks) + 3 layers (conv1, bn1, relu, maxpool, each
// Bottleneck, avgpool, flatten, fc), for corpc::pipeline to cut anywhere. The tutorial's split is after layer2:
// {4 + blocks[0] + blocks[1], blocks[2] + blocks[3] + 3}.
torch::nn::Sequential make_resnet_sequential(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes,
                                             uint64_t seed);
std::vector<int> tutorial_balance(const std::vector<int64_t>& blocks);
ResNetConfig make_config(int64_t base_width, const std::vector<int64_t>& blocks, int64_t num_classes);

// Deterministic inputs independent of the global RNG, so runs with
// different split counts train on identical data.
torch::Tensor one_hot_labels(int64_t batch, int64_t num_classes, uint64_t seed);
torch::Tensor random_images(int64_t batch, int64_t image_size, uint64_t seed);

}  // namespace corpc::examples
