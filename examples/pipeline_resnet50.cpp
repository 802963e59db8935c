// PyTorch's "Distributed Pipeline Parallelism Using RPC" tutorial, written with corpc.
//
//   build/examples/pipeline_resnet50 [--splits 4] [--batch-size 32] [--image-size 64] [--num-batches 3]
//
// ResNet50 is cut in two shards that live on worker1 and worker2; the master splits each batch into micro-batches
// and streams them through the shards as co_await chains: shard 1's output stays on worker1 as an RRef and worker2
// pulls it from there. Training uses distributed autograd and DistributedOptimizer. (The library's pipeline,
// corpc::pipeline::Pipeline, runs per-stage schedules without distributed autograd; bench/pipeline_bench.cpp measures
// it against this tutorial's code in PyTorch.)
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <chrono>
#include <cstdio>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/autograd/optimizer.hpp"
#include "corpc/corpc.hpp"
#include "corpc/rref/rref.hpp"

#include "../bench/bench_util.hpp"
#include "resnet/resnet_shards.hpp"

using namespace corpc;
using namespace corpc::examples;

const std::vector<std::int64_t> kBlocks{3, 4, 6, 3};

// A shard as a remote object. One micro-batch at a time per shard, like the tutorial's lock, without a mutex.
template <class Net>
struct Shard {
  static constexpr bool corpc_serialized_calls = true;
  Net net;

  Task<at::Tensor> forward(RRef<at::Tensor> x_rref) {
    at::Tensor x = co_await x_rref.to_here();  // from wherever it lives: the master, or the other shard
    co_return net->forward(x);
  }
  std::vector<RRef<at::Tensor>> parameter_rrefs() {
    std::vector<RRef<at::Tensor>> out;
    for (auto& p : net->parameters()) out.emplace_back(p);
    return out;
  }
};
using Shard1 = Shard<ResNetShard1>;
using Shard2 = Shard<ResNetShard2>;

Shard1 make_shard1_object(std::int64_t width) { return Shard1{make_shard1(width, kBlocks, 1000, 0)}; }
Shard2 make_shard2_object(std::int64_t width) { return Shard2{make_shard2(width, kBlocks, 1000, 1)}; }

class DistResNet50 {
 public:
  DistResNet50(int splits, std::int64_t width)
      : splits_(splits),
        p1_(remote<&make_shard1_object>("worker1", width)),
        p2_(remote<&make_shard2_object>("worker2", width)) {}

  Task<at::Tensor> forward(at::Tensor xs) {
    std::vector<Future<at::Tensor>> outs;
    for (auto& x : xs.chunk(splits_)) {
      RRef<at::Tensor> y = p1_.remote<&Shard1::forward>(RRef<at::Tensor>(x));  // owned by worker1, returns at once
      outs.push_back(p2_.rpc_async<&Shard2::forward>(y));                      // worker2 pulls y from worker1
    }
    co_return at::cat(co_await when_all(std::move(outs)));
  }

  std::vector<RRef<at::Tensor>> parameter_rrefs() const {
    auto ps = p1_.rpc_sync<&Shard1::parameter_rrefs>();
    auto more = p2_.rpc_sync<&Shard2::parameter_rrefs>();
    ps.insert(ps.end(), more.begin(), more.end());
    return ps;
  }

 private:
  int splits_;
  RRef<Shard1> p1_;
  RRef<Shard2> p2_;
};

Task<void> train(DistResNet50& model, const DistributedOptimizer<torch::optim::SGD>& opt, long batches, long batch,
                 long image) {
  for (long b = 0; b < batches; ++b) {
    auto inputs = random_images(batch, image, 1000 + b);
    auto labels = one_hot_labels(batch, 1000, 2000 + b);
    auto t0 = std::chrono::steady_clock::now();
    dist_autograd::Context ctx;
    auto out = co_await model.forward(inputs);
    auto loss = torch::nn::functional::mse_loss(out, labels);
    co_await ctx.backward(loss);
    co_await opt.step(ctx);
    std::printf("batch %ld: loss %.5f, %.2f s\n", b + 1, loss.item<double>(),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

int main(int argc, char** argv) {
  bench::Flags flags(argc, argv);
  const long splits = flags.get_int("splits", 4), batch = flags.get_int("batch-size", 32);
  const long image = flags.get_int("image-size", 64), batches = flags.get_int("num-batches", 3);
  const long width = flags.get_int("base-width", 64);
  auto body = [&](int rank) {
    RpcOptions options;
    options.worker_thread_init = [] { at::set_num_threads(1); };
    at::set_num_threads(1);
    bench::set_blas_threads(1);
    init_rpc(rank == 0 ? "master" : "worker" + std::to_string(rank), rank, 3, options);
    if (rank == 0) {
      DistResNet50 model(static_cast<int>(splits), width);
      DistributedOptimizer<torch::optim::SGD> opt(model.parameter_rrefs(), torch::optim::SGDOptions(0.05));
      sync_wait(train(model, opt, batches, batch, image));
    }
    shutdown();
  };
  try {
    launch_processes(3, body);  // three local processes, or this rank of a launcher's world (WORLD_SIZE must be 3)
  } catch (const std::exception& e) {  // a dead peer, a timeout: one line and a non-zero status, not std::terminate
    std::fprintf(stderr, "pipeline_resnet50: %s\n", e.what());
    return 1;
  }
  return 0;
}
