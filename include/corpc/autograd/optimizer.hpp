/// @file
/// DistributedOptimizer: one libtorch optimizer per owner of the parameters.
///
/// ```cpp
///   corpc::DistributedOptimizer<torch::optim::SGD> opt(model.parameter_rrefs(), torch::optim::SGDOptions(0.05));
///   ... inside a dist_autograd::Context, after backward:
///   co_await opt.step(ctx);      // every owner applies that context's gradients, concurrently
/// ```
///
/// The optimizer's options travel to the owners, so they need a corpc::Codec; SGD, Adam, AdamW, Adagrad and RMSprop
/// options have one below. Steps on one owner are serialized (the optimizer object opts into serialized calls);
/// gradients come from the context, so `.grad` is set only for the duration of the step and cleared after it.
#pragma once

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <map>
#include <mutex>
#include <vector>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/rref/detail/owned_call.hpp"
#include "corpc/rref/rref.hpp"

namespace corpc {

/// @cond INTERNAL
// The options' codecs: their members are the Codec contract (corpc/wire/codec.hpp), nothing more.
template <>
struct Codec<torch::optim::SGDOptions> {
  using O = torch::optim::SGDOptions;
  static void write(Writer& w, const O& o) {
    w.put(std::make_tuple(o.lr(), o.momentum(), o.dampening(), o.weight_decay(), o.nesterov()));
  }
  static O read(Reader& r) {
    auto [lr, momentum, dampening, wd, nesterov] = r.get<std::tuple<double, double, double, double, bool>>();
    return O(lr).momentum(momentum).dampening(dampening).weight_decay(wd).nesterov(nesterov);
  }
};

namespace detail {
template <class O>
struct AdamLikeCodec {
  static void write(Writer& w, const O& o) {
    w.put(std::make_tuple(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(),
                          o.amsgrad()));
  }
  static O read(Reader& r) {
    auto [lr, b1, b2, eps, wd, amsgrad] = r.get<std::tuple<double, double, double, double, double, bool>>();
    return O(lr).betas({b1, b2}).eps(eps).weight_decay(wd).amsgrad(amsgrad);
  }
};
}  // namespace detail
template <>
struct Codec<torch::optim::AdamOptions> : detail::AdamLikeCodec<torch::optim::AdamOptions> {};
template <>
struct Codec<torch::optim::AdamWOptions> : detail::AdamLikeCodec<torch::optim::AdamWOptions> {};

template <>
struct Codec<torch::optim::AdagradOptions> {
  using O = torch::optim::AdagradOptions;
  static void write(Writer& w, const O& o) {
    w.put(std::make_tuple(o.lr(), o.lr_decay(), o.weight_decay(), o.initial_accumulator_value(), o.eps()));
  }
  static O read(Reader& r) {
    auto [lr, decay, wd, init, eps] = r.get<std::tuple<double, double, double, double, double>>();
    return O(lr).lr_decay(decay).weight_decay(wd).initial_accumulator_value(init).eps(eps);
  }
};

template <>
struct Codec<torch::optim::RMSpropOptions> {
  using O = torch::optim::RMSpropOptions;
  static void write(Writer& w, const O& o) {
    w.put(std::make_tuple(o.lr(), o.alpha(), o.eps(), o.weight_decay(), o.momentum(), o.centered()));
  }
  static O read(Reader& r) {
    auto [lr, alpha, eps, wd, momentum, centered] = r.get<std::tuple<double, double, double, double, double, bool>>();
    return O(lr).alpha(alpha).eps(eps).weight_decay(wd).momentum(momentum).centered(centered);
  }
};
/// @endcond

namespace detail {

// Lives on one owner: a local optimizer over that owner's parameters.
template <class Opt, class Options>
class LocalOptimizer {
 public:
  static constexpr bool corpc_serialized_calls = true;  // concurrent steps on one owner go one at a time

  // The parameters are looked up at the first step, not here: the optimizer is usually created right after the
  // remote() calls that make them, and this creation may run on the owner before theirs have finished.
  LocalOptimizer(std::vector<RRef<at::Tensor>> params, Options options)
      : refs_(std::move(params)), options_(std::move(options)) {}

  void step(std::int64_t context_id) {
    // One step of this optimizer type at a time in the process, as PyTorch's _LocalOptimizer does (its lock is
    // global): several DistributedOptimizers (one per trainer) may hold the same parameters, and each sets their
    // .grad for the duration of its step.
    static std::mutex all_local_optimizers;
    std::lock_guard lock(all_local_optimizers);
    if (!optimizer_) {
      for (auto& p : refs_) params_.push_back(p.local_value());  // shares the parameter's storage
      optimizer_ = std::make_unique<Opt>(params_, options_);
    }
    auto grads = dist_autograd::get_gradients(context_id);
    for (auto& p : params_) {
      auto it = grads.find(p);
      p.mutable_grad() = it == grads.end() ? at::Tensor() : it->second;
    }
    optimizer_->step();
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }

 private:
  std::vector<RRef<at::Tensor>> refs_;
  Options options_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<Opt> optimizer_;
};

}  // namespace detail

/// One `Opt` (a torch::optim optimizer type) on each worker that owns some of the parameters, stepped together with
/// the gradients of a distributed autograd context (see corpc/autograd/optimizer.hpp). Copies step the same remote
/// optimizers; `step` may be called from any thread or coroutine.
template <class Opt>
class DistributedOptimizer {
 public:
  /// Creates, on each owner of `params`, an `Opt` over the parameters it owns, with `options` (its Options type,
  /// such as torch::optim::SGDOptions, which needs a corpc::Codec). Returns without waiting for the owners; a creation
  /// that fails (an owner died) fails every later step with that error. Parameters still being computed when this
  /// returns are fine: each owner looks its parameters up at the first step.
  /// Throws ShutdownError without a running runtime.
  template <class Options>
  DistributedOptimizer(const std::vector<RRef<at::Tensor>>& params, const Options& options) {
    using Local = detail::LocalOptimizer<Opt, Options>;
    std::map<int, std::vector<RRef<at::Tensor>>> by_owner;
    for (auto& p : params) by_owner[p.owner().rank].push_back(p);
    const int self = Runtime::get().rank();
    std::function<Future<void>(std::int64_t)> self_step;
    for (auto& [owner, ps] : by_owner) {
      auto local = remote<Local>(owner, ps, options);
      if (owner != self) {
        steps_.push_back([local](std::int64_t ctx) { return local.template rpc_async<&Local::step>(ctx); });
        continue;
      }
      // This worker's own optimizer: called here without a message to itself. Last in steps_, so that the other
      // owners' requests leave before it runs.
      self_step = detail::owned_member_call<&Local::step>(local);
    }
    if (self_step) steps_.push_back(std::move(self_step));
  }

  /// Applies the gradients of `context_id` on every owner, concurrently; completes when all have stepped, or fails
  /// with the first owner's error (errors as for rpc_async). Steps on one owner run one at a time. This worker's own
  /// share (if it owns parameters) is no message: called on a worker-pool thread, it runs right there once the other
  /// owners' requests have left; from another thread it is queued on the pool (an I/O thread sends it to itself).
  Future<void> step(std::int64_t context_id) const {
    std::vector<Future<void>> all;
    for (auto& s : steps_) all.push_back(s(context_id));
    return when_all(std::move(all));
  }
  /// step(ctx.id()).
  Future<void> step(const dist_autograd::Context& ctx) const { return step(ctx.id()); }

 private:
  std::vector<std::function<Future<void>(std::int64_t)>> steps_;
};

}  // namespace corpc
