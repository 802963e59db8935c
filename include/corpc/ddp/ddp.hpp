/// @file
/// DistributedDataParallel for libtorch's C++ frontend, on c10d process groups.
///
/// ```cpp
///   auto pg = corpc::ddp::init_process_group();          // env:// rendezvous (RANK, WORLD_SIZE, MASTER_ADDR/PORT)
///   corpc::ddp::DistributedDataParallel ddp(torch::nn::Linear(8, 4), pg);
///   torch::optim::SGD opt(ddp->parameters(), 0.1);
///   auto loss = ddp.forward(x).pow(2).mean();           // x: this rank's share of the batch
///   loss.backward();                                     // gradients are averaged over ranks, bucket by bucket,
///   opt.step();                                          // while backward still runs
/// ```
///
/// What it does, as PyTorch's DDP does:
/// - at construction, parameters and buffers are broadcast from rank 0, so every rank starts from the same model;
/// - gradients are grouped into buckets of about `bucket_cap_mb` (the first one at most 1 MiB), in reverse
///   registration order (roughly the order backward produces them); a hook on each parameter's gradient accumulator
///   copies the gradient, divided by the world size, into its bucket, and a full bucket's allreduce starts at once,
///   in bucket order on every rank (collectives must match up);
/// - at the end of backward (an autograd engine callback) it waits for every bucket, and writes the averaged
///   gradients back into `param.grad()`. Parameters that got no gradient in this backward count as zero, so every
///   rank takes part in every bucket's allreduce and nothing hangs; `find_unused_parameters` (a graph walk after
///   forward, as in PyTorch) lets their buckets start early instead of at the end of backward;
/// - `no_sync()` returns a guard under which backward only accumulates locally; the next synchronised backward
///   averages the accumulated sum, exactly as in PyTorch;
/// - the communication hook is replaceable: `fp16_compress_hook()`, `allreduce_hook()` (what the built-in default
///   does, as a hook) or your own.
///
/// Every rank must run the same number of synchronised backward passes, unless the training loop runs under `Join`
/// (uneven inputs: a rank that ran out of batches shadows the others' collectives until all have run out).
/// The process group: Gloo on CPU tensors. A NCCL group (CUDA builds) can be passed in as any c10d::ProcessGroup.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

namespace corpc::ddp {

/// How init_process_group makes its group.
struct ProcessGroupOptions {
  /// Collective timeout: a rank that waits longer than this on a peer fails instead of hanging.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  /// Keys of this group live under this prefix in the rendezvous store (followed by the group's number in this
  /// process: groups made one after another, in the same order on every rank, do not collide).
  std::string store_prefix = "corpc/ddp/";
  /// This process's rank and the group's size; -1: from the environment (RANK, WORLD_SIZE; Slurm's SLURM_PROCID,
  /// SLURM_NTASKS; Open MPI's), else RPC's (if init_rpc ran). A group of the first N RPC workers (trainers beside
  /// parameter servers) sets both.
  int rank = -1;
  int world_size = -1;  ///< see rank
};

/// A Gloo process group, from the same rendezvous as RPC when possible. The store:
/// - after init_rpc: an RpcStore (corpc/ddp/rpc_store.hpp) on RPC's rank 0: one MASTER_PORT for RPC and DDP;
/// - under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent's TCPStore at MASTER_ADDR:MASTER_PORT;
/// - under corpc::launch_processes (whose rank 0 keeps MASTER_PORT for RPC) a FileStore in /tmp unique to the launch;
/// - otherwise a TCPStore served by rank 0 on MASTER_PORT.
///
/// Collective: every rank of the group calls it, and it returns once all have joined. Throws std::runtime_error if
/// the rendezvous variables it needs are not set, std::invalid_argument if the rank is not below the group size, and
/// c10d's or corpc's (TimeoutError) error if the rendezvous fails. Sets SIGPIPE to ignored unless the program
/// installed a handler: Gloo writes to a dead member's socket without MSG_NOSIGNAL, and the survivors must fail with
/// the collective's error, not die of the signal (Python ignores SIGPIPE from the start; C++ does not).
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options = {});

/// What a communication hook gets: one bucket of this rank's gradients, flattened.
struct GradBucket {
  at::Tensor buffer;  ///< this rank's gradients; the hook may reduce into it in place
  size_t index;       ///< bucket number, in launch order (the same on every rank)
  int64_t divisor;    ///< what the sum is divided by: the world size, or under Join the ranks still training
};

/// A communication hook returns a future whose value is the bucket averaged over the group (a Tensor, or a TensorList
/// whose first element is it). Returning `bucket.buffer` itself saves a copy.
using CommHook =
    std::function<c10::intrusive_ptr<c10::ivalue::Future>(c10d::ProcessGroup& group, const GradBucket& bucket)>;

/// Allreduce in place, then divide.
CommHook allreduce_hook();
/// Divide, cast to float16, allreduce, cast back: half the bytes on the wire, ~1e-3 relative error per gradient.
CommHook fp16_compress_hook();

/// How DistributedDataParallel synchronises gradients (PyTorch's DDP arguments of the same names).
struct DdpOptions {
  double bucket_cap_mb = 25.0;  ///< target bucket size in MiB (the first bucket is at most 1 MiB)
  /// Walk the autograd graph after each forward to find parameters that will get no gradient, so that the buckets
  /// holding them can start before backward ends. Without it such parameters still count as zero (nothing hangs),
  /// but their buckets, and every bucket after them, wait for the end of backward.
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;  ///< rank 0's buffers (BatchNorm statistics, say) to all ranks before each forward
  /// Gradients are views into the bucket buffers: backward accumulates straight into the buckets and the averages
  /// land in `.grad` with no copy either way (saves one gradient-sized copy each way and the memory of one copy).
  /// `.grad` is then a slice of a shared buffer: replace it (`grad = ...`) rather than resize it in place.
  bool gradient_as_bucket_view = false;
  /// Empty: the built-in allreduce, which divides the gradients on their way into the bucket (one pass over them
  /// less than allreduce_hook(), which divides the sum), as PyTorch's DDP does when no hook is registered.
  CommHook comm_hook;
};

/// How a Join divides gradients while some ranks have run out of batches.
struct JoinOptions {
  /// PyTorch's default: the sum of gradients is divided by the world size even when some ranks have joined (they
  /// contribute zeros), so a step taken by fewer ranks is smaller. false: divided by the number of ranks that still
  /// train, so each step is the average over the batches actually run (one process on their concatenation).
  bool divide_by_initial_world_size = true;
};

/// The gradient machinery, independent of the module's forward signature.
/// Used through DistributedDataParallel; a wrapper of your own (another forward signature) can drive it directly:
/// before_forward(), the module's forward, after_forward(output), then backward as usual. Not thread-safe: one
/// training loop drives it, on one thread at a time.
class GradientSync {
 public:
  /// Broadcasts `module`'s parameters and buffers from rank 0 (collective: every rank constructs one), builds the
  /// buckets and hooks every parameter's gradient accumulator. `module` must outlive it.
  GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options);
  /// The tag of the constructor below.
  struct Manual {};
  /// For gradients made by many backward passes that together are one (a pipeline stage's micro-batches, zero
  /// bubble's weight passes): no hook on the accumulators and no broadcast (the caller keeps the ranks' models equal);
  /// the caller says when the gradients are complete with launch_all() and takes the averages with finish_launched().
  GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options, Manual);
  ~GradientSync();
  GradientSync(const GradientSync&) = delete;
  GradientSync& operator=(const GradientSync&) = delete;

  void before_forward();                         ///< broadcasts buffers if asked
  void after_forward(const at::Tensor& output);  ///< find_unused_parameters' graph walk
  void set_sync(bool enabled);                   ///< false: backward accumulates locally only
  void join_begin(JoinOptions options);          ///< see Join; std::logic_error if a join is open already
  void join_finish();                            ///< Join::finish()
  void join_abandon();                           ///< closes a join without shadowing the others (Join's destructor)
  bool sync_enabled() const;                     ///< false under no_sync()
  size_t bucket_count() const;                   ///< the number of gradient buckets
  /// Buckets whose allreduce started from a gradient hook, that is, while the last synchronised backward still ran
  /// (the rest started in the end-of-backward callback). The overlap, observable without a clock.
  size_t buckets_launched_during_last_backward() const;
  /// Manual mode: starts every bucket's allreduce, in bucket order, from the gradients as they are now (none: zero).
  void launch_all();
  /// Manual mode: waits for the buckets launch_all() started and puts the averages into `.grad`. Throws, as backward
  /// does, if a collective failed.
  void finish_launched();

  /// @cond INTERNAL
  struct State;
  /// @endcond

 private:
  std::shared_ptr<State> state_;
};

/// Data parallelism as PyTorch's DDP (see corpc/ddp/ddp.hpp): every rank wraps the same model, feeds it its
/// own share of the batch, and after each backward holds gradients averaged over the group. `ModuleT` is a module
/// holder (torch::nn::Linear, a TORCH_MODULE type) or a std::shared_ptr to a module. Collective: every rank
/// must construct it, run the same number of synchronised backward passes (unless under join()) and use the same
/// options. Errors of a collective (a rank died, the group's timeout) are thrown from backward as c10d's errors or as
/// std::runtime_error naming the bucket and rank.
template <typename ModuleT>
class DistributedDataParallel {
 public:
  /// Wraps `module` and broadcasts its parameters and buffers from rank 0 over `group` (collective).
  DistributedDataParallel(ModuleT module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options = {})
      : module_(std::move(module)),
        sync_(std::make_unique<GradientSync>(*module_, std::move(group), std::move(options))) {}

  /// The module's forward, with DDP's part around it: the Join vote and buffer broadcast before, the unused-
  /// parameter search after (when asked for). Returns what the module's forward returns.
  template <typename... Args>
  auto forward(Args&&... args) {
    sync_->before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    if constexpr (std::is_convertible_v<decltype(output), at::Tensor>) sync_->after_forward(output);
    return output;
  }

  ModuleT& module() { return module_; }                         ///< the wrapped module (checkpoint it through this)
  decltype(auto) operator->() { return module_.operator->(); }  ///< the module's members: `ddp->parameters()`
  GradientSync& gradient_sync() { return *sync_; }              ///< the gradient machinery (bucket counts, overlap)

  /// Gradient accumulation: backward passes made while the guard lives only accumulate locally.
  class NoSyncGuard {
   public:
    /// Turns synchronisation off until destroyed (then restores what it was).
    explicit NoSyncGuard(GradientSync& s) : s_(s), prev_(s.sync_enabled()) { s_.set_sync(false); }
    ~NoSyncGuard() { s_.set_sync(prev_); }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    GradientSync& s_;
    bool prev_;
  };
  /// PyTorch's `with ddp.no_sync():`: backward passes while the guard lives accumulate locally; the next
  /// synchronised backward averages the sum.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*sync_); }

  /// Uneven inputs, as PyTorch's `with Join([ddp]):` — see Join below.
  class Join;
  /// Opens a Join (see Join) for a training loop whose ranks may run different numbers of batches; std::logic_error if
  /// one is open already.
  [[nodiscard]] Join join(JoinOptions options = {});

 private:
  ModuleT module_;
  std::unique_ptr<GradientSync> sync_;
};

/// Ranks with different numbers of batches (PyTorch's Join context manager with DDP):
///
/// ```cpp
///   auto join = ddp.join();
///   for (auto& [x, y] : my_batches) { opt.zero_grad(); loss(ddp.forward(x), y).backward(); opt.step(); }
///   join.finish();
/// ```
///
/// While the join is open, each forward first takes part in one small allreduce saying which ranks still train (and
/// whether this step synchronises gradients). `finish()` makes this rank *joined*: it keeps answering that allreduce
/// with "not training", and shadows each step of the others (buffer broadcast from the highest rank still training,
/// one allreduce of zeros per bucket) until every rank has finished; then every rank adopts the parameters and buffers
/// of the highest rank among the last ones training (a joined rank took no optimizer steps meanwhile, so its own are
/// stale; its optimizer state, e.g. momentum, stays stale as in PyTorch). Gradients are divided as JoinOptions says.
/// A Join destroyed without finish() (an exception) only stops the per-forward allreduce: the others then fail with
/// a collective error or timeout instead of hanging forever.
template <typename ModuleT>
class DistributedDataParallel<ModuleT>::Join {
 public:
  /// Opens the join on `sync` (use DistributedDataParallel::join()).
  Join(GradientSync& sync, JoinOptions options) : sync_(&sync) { sync_->join_begin(options); }
  /// Without finish(): stops taking part in the per-forward vote (see above).
  ~Join() {
    if (sync_ != nullptr) sync_->join_abandon();
  }
  /// Takes over `other`'s open join.
  Join(Join&& other) noexcept : sync_(std::exchange(other.sync_, nullptr)) {}
  Join& operator=(Join&&) = delete;

  /// Shadows the other ranks until all have finished, then synchronises the final model. Collective: every rank calls
  /// it.
  void finish() {
    auto* s = std::exchange(sync_, nullptr);
    if (s != nullptr) s->join_finish();
  }

 private:
  GradientSync* sync_;
};

template <typename ModuleT>
typename DistributedDataParallel<ModuleT>::Join DistributedDataParallel<ModuleT>::join(JoinOptions options) {
  return Join(*sync_, options);
}

}  // namespace corpc::ddp
