// corpc/ddp/ddp.hpp — DistributedDataParallel for libtorch's C++ frontend, on c10d process groups.
//
//   auto pg = corpc::ddp::init_process_group();          // env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
//   corpc::ddp::DistributedDataParallel ddp(torch::nn::Linear(8, 4), pg);
//   torch::optim::SGD opt(ddp->parameters(), 0.1);
//   auto loss = ddp.forward(x).pow(2).mean();           // x: this rank's share of the batch
//   loss.backward();                                     // gradients are averaged over ranks, bucket by bucket,
//   opt.step();                                          // while backward still runs
//
// What it does, as PyTorch's DDP does:
// - at construction, parameters and buffers are broadcast from rank 0, so every rank starts from the same model;
// - gradients are grouped into buckets of about `bucket_cap_mb` (the first one at most 1 MiB), in reverse registration order (roughly the order
//   backward produces them); a hook on each parameter's gradient accumulator copies the gradient into its bucket,
//   and a full bucket's allreduce starts at once, in bucket order on every rank (collectives must match up);
// - at the end of backward (an autograd engine callback) it waits for every bucket, and writes the averaged
//   gradients back into `param.grad()`. Parameters that got no gradient in this backward count as zero, so every
//   rank takes part in every bucket's allreduce and nothing hangs; `find_unused_parameters` (a graph walk after
//   forward, as in PyTorch) lets their buckets start early instead of at the end of backward;
// - `no_sync()` returns a guard under which backward only accumulates locally; the next synchronised backward
//   averages the accumulated sum, exactly as in PyTorch;
// - the communication hook is replaceable: `allreduce_hook()` (default) or `fp16_compress_hook()`.
//
// Every rank must run the same number of synchronised backward passes (there is no `join` yet).
// The process group: Gloo on CPU tensors. A NCCL group (CUDA builds) can be passed in as any c10d::ProcessGroup.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

namespace corpc::ddp {

struct ProcessGroupOptions {
  // Collective timeout: a rank that waits longer than this on a peer fails instead of hanging.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Keys of this group live under this prefix in the rendezvous store.
  std::string store_prefix = "corpc/ddp/";
};

// A Gloo process group from the environment, as torchrun and corpc::launch_processes set it (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT). The store:
// - under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent's TCPStore at MASTER_ADDR:MASTER_PORT;
// - under corpc::launch_processes (whose rank 0 keeps MASTER_PORT for RPC) a FileStore in /tmp unique to the launch;
// - otherwise a TCPStore served by rank 0 on MASTER_PORT.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options = {});

// A communication hook gets one flat bucket of gradients (summed over nothing yet) and returns a future whose value
// is the bucket averaged over the group (a Tensor, or a TensorList whose first element is it).
using CommHook =
    std::function<c10::intrusive_ptr<c10::ivalue::Future>(c10d::ProcessGroup& group, const at::Tensor& bucket)>;

// Allreduce, then divide by the world size.
CommHook allreduce_hook();
// Divide, cast to float16, allreduce, cast back: half the bytes on the wire, ~1e-3 relative error per gradient.
CommHook fp16_compress_hook();

struct DdpOptions {
  double bucket_cap_mb = 25.0;
  // Walk the autograd graph after each forward to find parameters that will get no gradient, so that the buckets
  // holding them can start before backward ends. Without it such parameters still count as zero (nothing hangs),
  // but their buckets, and every bucket after them, wait for the end of backward.
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;  // rank 0's buffers (e.g. BatchNorm statistics) to all ranks before each forward
  CommHook comm_hook;             // empty: allreduce_hook()
};

// The gradient machinery, independent of the module's forward signature.
class GradientSync {
 public:
  GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  void before_forward();                          // broadcasts buffers if asked
  void after_forward(const at::Tensor& output);   // find_unused_parameters' graph walk
  void set_sync(bool enabled);         // false: backward accumulates locally only
  bool sync_enabled() const;
  size_t bucket_count() const;
  // Buckets whose allreduce started from a gradient hook, i.e. while the last synchronised backward still ran
  // (the rest started in the end-of-backward callback). The overlap, observable without a clock.
  size_t buckets_launched_during_last_backward() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Wraps a module holder (torch::nn::Linear, a TORCH_MODULE type) or a std::shared_ptr to a module.
template <typename ModuleT>
class DistributedDataParallel {
 public:
  DistributedDataParallel(ModuleT module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options = {})
      : module_(std::move(module)), sync_(std::make_unique<GradientSync>(*module_, std::move(group), std::move(options))) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    sync_->before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    if constexpr (std::is_convertible_v<decltype(output), at::Tensor>) sync_->after_forward(output);
    return output;
  }

  ModuleT& module() { return module_; }
  decltype(auto) operator->() { return module_.operator->(); }
  GradientSync& gradient_sync() { return *sync_; }

  // Gradient accumulation: backward passes made while the guard lives only accumulate locally.
  class NoSyncGuard {
   public:
    explicit NoSyncGuard(GradientSync& s) : s_(s), prev_(s.sync_enabled()) { s_.set_sync(false); }
    ~NoSyncGuard() { s_.set_sync(prev_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    GradientSync& s_;
    bool prev_;
  };
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*sync_); }

 private:
  ModuleT module_;
  std::unique_ptr<GradientSync> sync_;
};

}  // namespace corpc::ddp
