#include "resnet_shards.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/utils.h>

namespace corpc::examples {
namespace nn = torch::nn;

namespace {

nn::Conv2d conv(int64_t in, int64_t out, int64_t k, int64_t stride, int64_t pad) {
  nn::Conv2d c(nn::Conv2dOptions(in, out, k).stride(stride).padding(pad).bias(false));
  // torchvision's init; libtorch's default (kaiming_uniform a=sqrt(5)) would
  // make the deep stack's activations shrink.
  nn::init::kaiming_normal_(c->weight, 0.0, torch::kFanOut, torch::kReLU);
  return c;
}

nn::BatchNorm2d bn(int64_t channels) {
  // Default BN init is already weight=1, bias=0 as torchvision wants.
  return nn::BatchNorm2d(channels);
}

// Appends `blocks` Bottlenecks; only the first may change stride/width.
nn::Sequential make_layer(int64_t& inplanes, int64_t planes, int64_t blocks, int64_t stride) {
  nn::Sequential layer;
  for (int64_t i = 0; i < blocks; ++i) {
    layer->push_back(Bottleneck(inplanes, planes, i == 0 ? stride : 1));
    inplanes = planes * BottleneckImpl::kExpansion;
  }
  return layer;
}

ResNetConfig with_width(int64_t base_width, int64_t num_classes = 1000) {
  ResNetConfig cfg;
  cfg.base_width = base_width;
  cfg.num_classes = num_classes;
  return cfg;
}

}  // namespace

BottleneckImpl::BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride) {
  conv1 = register_module("conv1", conv(inplanes, planes, 1, 1, 0));
  bn1 = register_module("bn1", bn(planes));
  conv2 = register_module("conv2", conv(planes, planes, 3, stride, 1));
  bn2 = register_module("bn2", bn(planes));
  conv3 = register_module("conv3", conv(planes, planes * kExpansion, 1, 1, 0));
  bn3 = register_module("bn3", bn(planes * kExpansion));
  if (stride != 1 || inplanes != planes * kExpansion) {
    downsample_conv = register_module("downsample_conv", conv(inplanes, planes * kExpansion, 1, stride, 0));
    downsample_bn = register_module("downsample_bn", bn(planes * kExpansion));
  }
}

torch::Tensor BottleneckImpl::forward(torch::Tensor x) {
  auto identity = downsample_conv ? downsample_bn(downsample_conv(x)) : x;
  auto out = torch::relu(bn1(conv1(x)));
  out = torch::relu(bn2(conv2(out)));
  out = bn3(conv3(out));
  return torch::relu(out + identity);
}

ResNetShard1Impl::ResNetShard1Impl(const ResNetConfig& cfg) {
  const int64_t w = cfg.base_width;
  int64_t inplanes = w;
  conv1 = register_module("conv1", conv(3, w, 7, 2, 3));
  bn1 = register_module("bn1", bn(w));
  maxpool = register_module("maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  layer1 = register_module("layer1", make_layer(inplanes, w, cfg.blocks[0], 1));
  layer2 = register_module("layer2", make_layer(inplanes, 2 * w, cfg.blocks[1], 2));
}

ResNetShard1Impl::ResNetShard1Impl(int64_t base_width) : ResNetShard1Impl(with_width(base_width)) {}

torch::Tensor ResNetShard1Impl::forward(torch::Tensor x) {
  x = maxpool(torch::relu(bn1(conv1(x))));
  return layer2->forward(layer1->forward(x));
}

ResNetShard2Impl::ResNetShard2Impl(const ResNetConfig& cfg) {
  const int64_t w = cfg.base_width;
  // Shard 2 starts where layer2 ended.
  int64_t inplanes = 2 * w * BottleneckImpl::kExpansion;
  layer3 = register_module("layer3", make_layer(inplanes, 4 * w, cfg.blocks[2], 2));
  layer4 = register_module("layer4", make_layer(inplanes, 8 * w, cfg.blocks[3], 2));
  avgpool = register_module("avgpool", nn::AdaptiveAvgPool2d(1));
  fc = register_module("fc", nn::Linear(inplanes, cfg.num_classes));
}

ResNetShard2Impl::ResNetShard2Impl(int64_t base_width, int64_t num_classes)
    : ResNetShard2Impl(with_width(base_width, num_classes)) {}

torch::Tensor ResNetShard2Impl::forward(torch::Tensor x) {
  x = layer4->forward(layer3->forward(x));
  return fc(torch::flatten(avgpool(x), 1));
}

ResNet50Impl::ResNet50Impl(const ResNetConfig& cfg) {
  shard1 = register_module("shard1", ResNetShard1(cfg));
  shard2 = register_module("shard2", ResNetShard2(cfg));
}

torch::Tensor ResNet50Impl::forward(torch::Tensor x) { return shard2(shard1(x)); }

ResNetConfig make_config(int64_t base_width, const std::vector<int64_t>& blocks, int64_t num_classes) {
  ResNetConfig cfg;
  cfg.base_width = base_width;
  for (size_t i = 0; i < cfg.blocks.size() && i < blocks.size(); ++i) cfg.blocks[i] = blocks[i];
  cfg.num_classes = num_classes;
  return cfg;
}

ResNetShard1 make_shard1(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes, uint64_t seed) {
  torch::manual_seed(seed);
  return ResNetShard1(make_config(base_width, blocks, num_classes));
}

ResNetShard2 make_shard2(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes, uint64_t seed) {
  torch::manual_seed(seed);
  return ResNetShard2(make_config(base_width, blocks, num_classes));
}

torch::nn::Sequential make_resnet_sequential(int64_t base_width, std::vector<int64_t> blocks, int64_t num_classes,
                                             uint64_t seed) {
  torch::manual_seed(seed);
  const auto cfg = make_config(base_width, blocks, num_classes);
  const int64_t w = cfg.base_width;
  nn::Sequential net;
  net->push_back("conv1", conv(3, w, 7, 2, 3));
  net->push_back("bn1", bn(w));
  net->push_back("relu", nn::ReLU());
  net->push_back("maxpool", nn::MaxPool2d(nn::MaxPool2dOptions(3).stride(2).padding(1)));
  int64_t inplanes = w;
  const int64_t widths[4] = {w, 2 * w, 4 * w, 8 * w};
  for (int l = 0; l < 4; ++l)
    for (int64_t i = 0; i < cfg.blocks[l]; ++i) {
      net->push_back("layer" + std::to_string(l + 1) + "_" + std::to_string(i),
                     Bottleneck(inplanes, widths[l], i == 0 && l > 0 ? 2 : 1));
      inplanes = widths[l] * BottleneckImpl::kExpansion;
    }
  net->push_back("avgpool", nn::AdaptiveAvgPool2d(1));
  net->push_back("flatten", nn::Flatten());
  net->push_back("fc", nn::Linear(inplanes, cfg.num_classes));
  return net;
}

std::vector<int> tutorial_balance(const std::vector<int64_t>& blocks) {
  return {static_cast<int>(4 + blocks.at(0) + blocks.at(1)), static_cast<int>(blocks.at(2) + blocks.at(3) + 3)};
}

torch::Tensor one_hot_labels(int64_t batch, int64_t num_classes, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto idx = torch::randint(num_classes, {batch, 1}, gen, torch::kLong);
  return torch::zeros({batch, num_classes}).scatter_(1, idx, 1.0);
}

torch::Tensor random_images(int64_t batch, int64_t image_size, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return torch::randn({batch, 3, image_size, image_size}, gen);
}

}  // namespace corpc::examples
