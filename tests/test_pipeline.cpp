// The pipelined ResNet (tiny configuration) against the same model in one process.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <signal.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "corpc/pipeline/pipeline.hpp"
#include "resnet_shards.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace corpc::examples;
using namespace std::chrono_literals;

namespace {

// Tiny but structurally the tutorial's model: every Bottleneck, downsample and both shards.
const std::int64_t kWidth = 2, kClasses = 10, kImage = 16, kBatch = 8;
const std::vector<std::int64_t> kBlocks{1, 1, 1, 1};

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::nn::functional::mse_loss(out, target); }
bool close(const at::Tensor& a, const at::Tensor& b) { return at::allclose(a, b, 1e-4, 1e-6); }

// One SGD step of the unsplit model in this process; returns (loss, parameters after the step).
std::pair<at::Tensor, std::vector<at::Tensor>> reference_step(const at::Tensor& x, const at::Tensor& y) {
  auto s1 = make_shard1(kWidth, kBlocks, kClasses, 1);
  auto s2 = make_shard2(kWidth, kBlocks, kClasses, 2);
  s1->eval();
  s2->eval();
  std::vector<at::Tensor> params;
  for (auto& p : s1->parameters()) params.push_back(p);
  for (auto& p : s2->parameters()) params.push_back(p);
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.05));
  auto loss = mse(s2->forward(s1->forward(x)), y);
  loss.backward();
  opt.step();
  return {loss.detach(), params};
}

}  // namespace

TEST_CASE("pipelined training with 1, 2 and 4 micro-batches equals the unsplit model in one process") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    auto x = random_images(kBatch, kImage, 7);
    auto y = one_hot_labels(kBatch, kClasses, 8);
    auto [ref_loss, ref_params] = reference_step(x, y);
    for (auto schedule : {pipeline::Schedule::GPipe, pipeline::Schedule::OneFOneB}) {
      for (int splits : {1, 2, 4}) {
        auto s1 = pipeline::remote_stage<&make_shard1>("worker1/cpu", kWidth, kBlocks, kClasses, std::uint64_t{1});
        auto s2 = pipeline::remote_stage<&make_shard2>("worker2/cpu", kWidth, kBlocks, kClasses, std::uint64_t{2});
        pipeline::Pipeline pipe({s1, s2}, splits, schedule);
        pipe.train(false);  // BatchNorm in eval mode: micro-batches then compute exactly what the whole batch does
        auto params = pipe.parameter_rrefs();
        DistributedOptimizer<torch::optim::SGD> opt(params, torch::optim::SGDOptions(0.05));
        auto loss = sync_wait(pipe.train_step(x, y, mse, opt));
        INFO("splits " << splits);
        EXPECT(close(loss, ref_loss));
        EXPECT_EQ(params.size(), ref_params.size());
        for (std::size_t i = 0; i < params.size(); ++i) EXPECT(close(params[i].to_here().wait(10s), ref_params[i]));
      }
    }
  }, quick_options(), std::chrono::seconds(300));
}

namespace {
std::atomic<int> g_calls{0};
// Shard 2, except that its worker dies on its second micro-batch.
struct DoomedShard2Impl : torch::nn::Module {
  ResNetShard2 inner;
  explicit DoomedShard2Impl(ResNetShard2 s) : inner(register_module("inner", std::move(s))) {}
  at::Tensor forward(at::Tensor x) {
    if (++g_calls == 2) ::raise(SIGKILL);
    return inner->forward(x);
  }
};
TORCH_MODULE(DoomedShard2);
DoomedShard2 make_doomed(std::uint64_t seed) { return DoomedShard2(make_shard2(kWidth, kBlocks, kClasses, seed)); }
}  // namespace

TEST_CASE("a worker dying mid-pipeline fails the step with a clear error, without a hang") {
  try {
    run_world(3, [](int rank) {
      if (rank != 0) return;
      auto s1 = pipeline::remote_stage<&make_shard1>("worker1/cpu", kWidth, kBlocks, kClasses, std::uint64_t{1});
      auto s2 = pipeline::remote_stage<&make_doomed>("worker2/cpu", std::uint64_t{2});
      pipeline::Pipeline pipe({s1, s2}, 4);
      auto params = s1.parameters();
      DistributedOptimizer<torch::optim::SGD> opt(params, torch::optim::SGDOptions(0.05));
      auto x = random_images(kBatch, kImage, 7);
      auto y = one_hot_labels(kBatch, kClasses, 8);
      auto msg = EXPECT_THROWS_AS(sync_wait(pipe.train_step(x, y, mse, opt)), RpcError);
      EXPECT(msg.find("worker2") != std::string::npos);
    });
    FAIL("worker2 was expected to die");
  } catch (const LaunchError& e) {
    INFO(e.what());
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].rank == 2);
  }
}
