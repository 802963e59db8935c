// corpc/pipeline/pipeline.hpp — pipeline parallelism over model shards on other workers.
//
//   auto s1 = corpc::pipeline::remote_stage<&make_shard1>("worker1/cpu", seed);   // a module built on worker1
//   auto s2 = corpc::pipeline::remote_stage<&make_shard2>("worker2/cpu", seed);
//   corpc::pipeline::Pipeline pipe({s1, s2}, /*micro_batches=*/4);
//   corpc::DistributedOptimizer<torch::optim::SGD> opt(pipe.parameter_rrefs(), torch::optim::SGDOptions(0.05));
//   at::Tensor loss = co_await pipe.train_step(images, labels, mse, opt);
//
// Each micro-batch is a chain of `remote()` calls: stage k's output stays on stage k's worker as an RRef and stage
// k+1 pulls it from there (never through the caller); only the last stage's output comes back. All micro-batches are
// in flight at once, so stage k works on micro-batch i+1 while stage k+1 works on micro-batch i.
//
// Each stage runs one micro-batch at a time, in arrival order (its host object opts into serialized calls, which is
// what the tutorial's per-shard lock does), without holding a thread while it waits for its input.
//
// Schedules, for K stages, M micro-batches, and per-batch forward+backward time T on one worker:
//   GPipe: all forwards, then one backward from the loss of the whole batch. Time ~ T (M + K - 1) / (M K) per stage
//          ideal (bubble fraction (K-1)/(M+K-1)); activations of all M micro-batches are alive at the peak.
//   OneFOneB: each micro-batch's backward starts as soon as its output is back (loss scaled by its share of the
//          batch, so the gradients equal GPipe's), overlapping backward of early micro-batches with forward of later
//          ones. Same bubble in this implementation; it would bound live activations to K micro-batches if graphs
//          were freed per micro-batch, but corpc keeps each context's graph until the context ends, so peak memory
//          is GPipe's.
// Both need a loss that is a mean over the batch (as MSE and cross-entropy with the default reduction are).
//
// BatchNorm and micro-batches: in training mode each stage normalizes each micro-batch with that micro-batch's own
// mean and variance, and updates the running statistics once per micro-batch; the unsplit batch uses one set of
// statistics over all of it. Results therefore differ from the unsplit model unless BatchNorm is in eval mode (or
// replaced, e.g. by GroupNorm), which is how the equivalence tests run.
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <vector>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/autograd/optimizer.hpp"
#include "corpc/rref/remote_module.hpp"

namespace corpc::pipeline {

enum class Schedule { GPipe, OneFOneB };

// Owns one stage's module on its worker. Serialized: one micro-batch at a time per stage.
template <class M>
class StageHost {
 public:
  static constexpr bool corpc_serialized_calls = true;

  StageHost(M module, std::string device) : module_(std::move(module)), device_(std::move(device)) {
    module_->to(c10::Device(device_));
  }
  at::Tensor forward(at::Tensor x) { return module_->forward(x.to(c10::Device(device_))); }
  void train(bool on) { module_->train(on); }
  std::vector<RRef<at::Tensor>> parameters() {
    std::vector<RRef<at::Tensor>> out;
    for (auto& p : module_->parameters()) out.emplace_back(p);
    return out;
  }
  M& module() { return module_; }

 private:
  M module_;
  std::string device_;
};

namespace detail {

template <auto Factory, class... A>
auto build_host(std::string device, A... args) {
  using M = std::decay_t<decltype(Factory(std::move(args)...))>;
  return StageHost<M>(Factory(std::move(args)...), std::move(device));
}

// Runs on the stage's worker: waits for the input (wherever it lives) first, then queues for the stage.
template <class M>
Task<at::Tensor> forward_from_ref(RRef<StageHost<M>> host, RRef<at::Tensor> input) {
  at::Tensor x = co_await input.to_here();
  auto slot = corpc::detail::RRefContext::get()->slot(host.state()->id);
  co_return co_await corpc::detail::invoke_member<&StageHost<M>::forward>(slot, std::make_tuple(std::move(x)));
}

}  // namespace detail

// A stage of a pipeline, independent of its module type.
struct Stage {
  int owner = -1;
  std::function<RRef<at::Tensor>(const at::Tensor&)> keep_from_tensor;          // result stays on the stage
  std::function<RRef<at::Tensor>(const RRef<at::Tensor>&)> keep_from_ref;
  std::function<Future<at::Tensor>(const at::Tensor&)> fetch_from_tensor;       // result comes back
  std::function<Future<at::Tensor>(const RRef<at::Tensor>&)> fetch_from_ref;
  std::function<std::vector<RRef<at::Tensor>>()> parameters;
  std::function<Future<void>(bool)> train;
};

// Builds `Factory(args...)` (a module holder) on the worker of `remote_device` ("worker1/cpu", "worker2/cuda:0").
template <auto Factory, class... A>
Stage remote_stage(const std::string& remote_device, A&&... args) {
  auto [worker, device] = corpc::detail::split_remote_device(remote_device);
  auto host = remote<&detail::build_host<Factory, std::decay_t<A>...>>(worker, device, std::forward<A>(args)...);
  using H = typename decltype(host)::value_type;
  using M = std::decay_t<decltype(std::declval<H&>().module())>;
  Stage s;
  s.owner = host.owner().rank;
  s.keep_from_tensor = [host](const at::Tensor& x) { return host.template remote<&H::forward>(x); };
  s.keep_from_ref = [host](const RRef<at::Tensor>& x) {
    return remote<&detail::forward_from_ref<M>>(host.owner().rank, host, x);
  };
  s.fetch_from_tensor = [host](const at::Tensor& x) { return host.template rpc_async<&H::forward>(x); };
  s.fetch_from_ref = [host](const RRef<at::Tensor>& x) {
    return rpc_async<&detail::forward_from_ref<M>>(host.owner().rank, host, x);
  };
  s.parameters = [host] { return host.template rpc_sync<&H::parameters>(); };
  s.train = [host](bool on) { return host.template rpc_async<&H::train>(on); };
  return s;
}

class Pipeline {
 public:
  Pipeline(std::vector<Stage> stages, int micro_batches, Schedule schedule = Schedule::GPipe)
      : stages_(std::move(stages)), micro_batches_(micro_batches), schedule_(schedule) {
    if (stages_.empty()) throw UsageError("a pipeline needs at least one stage");
    if (micro_batches_ < 1) throw UsageError("a pipeline needs at least one micro-batch");
  }

  int micro_batches() const noexcept { return micro_batches_; }
  Schedule schedule() const noexcept { return schedule_; }

  // Streams the micro-batches of `batch` through the stages; one future per micro-batch output, in order.
  std::vector<Future<at::Tensor>> forward_micro_batches(const at::Tensor& batch) const {
    std::vector<Future<at::Tensor>> outs;
    for (auto& x : batch.chunk(micro_batches_)) {
      if (stages_.size() == 1) {
        outs.push_back(stages_[0].fetch_from_tensor(x));
        continue;
      }
      RRef<at::Tensor> y = stages_[0].keep_from_tensor(x);
      for (std::size_t k = 1; k + 1 < stages_.size(); ++k) y = stages_[k].keep_from_ref(y);
      outs.push_back(stages_.back().fetch_from_ref(y));
    }
    return outs;
  }

  // The whole batch's output, concatenated on the caller.
  Future<at::Tensor> forward(const at::Tensor& batch) const {
    return wait_all(forward_micro_batches(batch)).then([](const std::vector<at::Tensor>& parts) { return at::cat(parts); });
  }

  std::vector<RRef<at::Tensor>> parameter_rrefs() const {
    std::vector<RRef<at::Tensor>> all;
    for (auto& s : stages_) {
      auto ps = s.parameters();
      all.insert(all.end(), ps.begin(), ps.end());
    }
    return all;
  }

  // Training or eval mode on every stage (BatchNorm, Dropout).
  void train(bool on) const {
    std::vector<Future<void>> all;
    for (auto& s : stages_) all.push_back(s.train(on));
    wait_all(std::move(all)).wait();
  }

  using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;
  using StepFn = std::function<Future<void>(std::int64_t context_id)>;

  // One iteration in a fresh distributed-autograd context: forward, loss, backward, optimizer step. Returns the loss.
  Task<at::Tensor> train_step(at::Tensor inputs, at::Tensor targets, LossFn loss, StepFn step) const {
    dist_autograd::Context ctx;
    at::Tensor total;
    if (schedule_ == Schedule::GPipe) {
      at::Tensor out = co_await forward(inputs);
      total = loss(out, targets);
      std::vector<at::Tensor> roots{total};  // a named local: GCC 12 rejects braced lists inside co_await
      co_await ctx.backward(std::move(roots));
    } else {
      auto outs = forward_micro_batches(inputs);
      auto target_parts = targets.chunk(micro_batches_);
      std::vector<Future<at::Tensor>> losses;
      for (std::size_t i = 0; i < outs.size(); ++i) {
        const double share = static_cast<double>(target_parts[i].size(0)) / static_cast<double>(targets.size(0));
        losses.push_back(spawn(backward_one(ctx.id(), outs[i], target_parts[i], share, loss)));
      }
      auto parts = co_await wait_all(std::move(losses));
      total = at::stack(parts).sum();
    }
    co_await step(ctx.id());
    co_return total.detach();
  }

  template <class Opt>
  Task<at::Tensor> train_step(at::Tensor inputs, at::Tensor targets, LossFn loss, const DistributedOptimizer<Opt>& opt) const {
    return train_step(std::move(inputs), std::move(targets), std::move(loss),
                      [&opt](std::int64_t ctx) { return opt.step(ctx); });
  }

 private:
  static Task<at::Tensor> backward_one(std::int64_t ctx, Future<at::Tensor> out, at::Tensor target, double share,
                                       LossFn loss) {
    at::Tensor y = co_await out;
    at::Tensor l = loss(y, target) * share;
    std::vector<at::Tensor> roots{l};
    co_await dist_autograd::backward(ctx, std::move(roots));
    co_return l.detach();
  }

  std::vector<Stage> stages_;
  int micro_batches_;
  Schedule schedule_;
};

}  // namespace corpc::pipeline
