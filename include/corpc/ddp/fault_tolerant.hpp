/// @file
/// Data-parallel training that survives a lost rank without stopping: a quorum per step, a process group per quorum,
/// and recovery of a replacement from a live peer instead of a checkpoint (in the spirit of torchft).
///
/// ```cpp
///   corpc::launch_processes(4, [](int rank) {               // rank 0 coordinates, ranks 1..3 train
///     corpc::init_rpc("rank" + std::to_string(rank));       // a restarted rank rejoins (CORPC_REJOIN=1)
///     if (rank == 0) {
///       corpc::ddp::QuorumCoordinator coordinator;          // answers the trainers' quorum and commit requests
///       corpc::shutdown();                                  // waits until the trainers are done
///       return;
///     }
///     Net net;
///     torch::optim::SGD opt(net->parameters(), 0.1);
///     corpc::ddp::FaultTolerantDdp<Net> ft(net, opt);
///     corpc::ddp::StepReport last;
///     while (ft.committed_steps() < 500 || last.quorum.member_count() < 3) {   // see "Finishing" below
///       last = ft.step([&](const corpc::ddp::Quorum& q) {  // forward and backward on this rank's share
///         auto [x, y] = batch(q.step, rank);
///         torch::mse_loss(ft.forward(x), y).backward();     // gradients averaged over q.members
///       });                                                 // then committed on every member, or retried
///     }
///     corpc::shutdown();
///   }, {.max_rank_restarts = 10});                          // a killed trainer is started again in place
/// ```
///
/// **A step.** `FaultTolerantDdp::step` asks the coordinator for the step's quorum (members, epoch, and whether this
/// rank must first load the state of a member); when the members changed since the last step, every member builds a
/// fresh Gloo group of the members under the epoch's own store prefix. Then `fn` runs forward and backward through a
/// DistributedDataParallel on that group: gradients are averaged over the members that take part. Every member then
/// votes on the step; the coordinator commits it only if every member's allreduce succeeded, and only then do the
/// members take the optimizer step. A step that failed anywhere (a member died or went silent during the allreduce)
/// is taken by nobody: the survivors ask for a new quorum and run the same step again, up to `max_retries` times,
/// without restarting. So no member ever applies a step another did not, and the survivors lose at most the step in
/// progress. A step without changes costs one request to the coordinator: the vote carries the request for the next
/// step's quorum, which the coordinator answers with the commit when every member asked so (a rank waiting to join
/// is taken in then); a new epoch answered that way is entered before `step` returns.
///
/// **Recovery.** A member that joins without the current state (a replacement the launcher restarted, or a rank that
/// was left out while it was stopped and so missed committed steps) is told so in its quorum: before the step it
/// fetches the parameters, buffers, optimizer state and step counter from one up-to-date member (the donor) by RPC,
/// bit for bit (large tensors over the same-host channel where there is one). No checkpoint is read. The donor
/// serves a copy taken at the step boundary, so it goes on at once.
///
/// **Finishing.** A replacement recovers from a live member: one that arrives after every member has left finds no
/// donor (it is refused with RpcError), and rank 0's graceful shutdown reports the ranks still missing. So the loop
/// above goes on past its last step until the quorum has every trainer again (examples/ddp_fault_tolerant.cpp
/// slows those extra steps down); a trainer whose restarts ran out fails the launch anyway. Under a launcher that
/// starts no replacement (srun, mpirun) end the loop at the last step instead, and set
/// `RpcOptions::lost_rank_fails_shutdown = false` on every rank so that the survivors' shutdown() succeeds.
///
/// **Liveness.** A member that does not ask for the quorum, or does not vote, within `QuorumOptions::join_timeout` of
/// the first member that did is left out of that quorum (a joining rank waits for the members' next step instead: it
/// never forms a quorum of its own while they are mid-step, and one that finds no member holding the last committed
/// state is refused with RpcError rather than starting over); the coordinator learns of a dead one at once (its RPC connection closed).
/// The coordinator is a corpc function on a designated rank (QuorumCoordinator): a rank whose only job is to answer is
/// the least likely to fail, and it is also RPC's rendezvous rank. If it dies, every trainer's next quorum or commit
/// request fails with ConnectionError naming it (within RPC's liveness bound if it only went silent); there is no
/// takeover.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "corpc/ddp/ddp.hpp"
#include "corpc/ddp/quorum.hpp"

namespace corpc::ddp {

/// The model-independent part of FaultTolerantDdp: quorum, epoch groups, recovery, commit. Use FaultTolerantDdp.
class FaultTolerantGroup {
 public:
  /// Trains `module` with `optimizer` (both must outlive it); after init_rpc. UsageError if one trains in this
  /// process already, or if the coordinator was made with replica groups (asked of it, waiting up to
  /// options.quorum_timeout for it to be made).
  FaultTolerantGroup(torch::nn::Module& module, torch::optim::Optimizer& optimizer, FaultTolerantOptions options);
  ~FaultTolerantGroup();
  FaultTolerantGroup(const FaultTolerantGroup&) = delete;
  FaultTolerantGroup& operator=(const FaultTolerantGroup&) = delete;

  /// See FaultTolerantDdp::step.
  StepReport step(const std::function<void(const Quorum&)>& fn);
  std::int64_t committed_steps() const;  ///< see FaultTolerantDdp::committed_steps
  /// The current epoch's gradient machinery (valid inside step's fn).
  GradientSync& gradient_sync();

  /// @cond INTERNAL
  struct State;
  /// @endcond

 private:
  std::shared_ptr<State> state_;
};

/// DistributedDataParallel that survives lost ranks (see corpc/ddp/fault_tolerant.hpp). `ModuleT` is a module holder
/// or a std::shared_ptr to a module; `optimizer` must optimize its parameters and outlive this. Every trainer
/// constructs one after init_rpc; a QuorumCoordinator must run on `options.coordinator_rank`. Constructing it sets
/// SIGPIPE to ignored unless the program installed a handler: Gloo writes to a dead member's socket without
/// MSG_NOSIGNAL, and the survivors must not die of it (Python ignores SIGPIPE from the start; C++ does not).
template <typename ModuleT>
class FaultTolerantDdp {
 public:
  /// Wraps `module`; no collective happens before the first step (whose group broadcasts the first member's model).
  FaultTolerantDdp(ModuleT module, torch::optim::Optimizer& optimizer, FaultTolerantOptions options = {})
      : module_(std::move(module)), group_(*module_, optimizer, std::move(options)) {}

  /// Runs one step: the quorum (and recovery, if this rank needs it), `fn(quorum)` — forward through forward() and
  /// backward on this rank's share of the step's batch; the gradients are zeroed before it — then the commit vote
  /// and, if committed, the optimizer step. A failed attempt is run again with a new quorum (up to max_retries);
  /// then the last error is thrown. Collective among the members: every trainer calls it in a loop.
  StepReport step(const std::function<void(const Quorum&)>& fn) { return group_.step(fn); }

  /// The module's forward through the current epoch's DistributedDataParallel (inside step's fn).
  template <typename... Args>
  auto forward(Args&&... args) {
    auto& sync = group_.gradient_sync();
    sync.before_forward();
    auto output = module_->forward(std::forward<Args>(args)...);
    if constexpr (std::is_convertible_v<decltype(output), at::Tensor>) sync.after_forward(output);
    return output;
  }

  /// Steps committed so far (a recovered rank's count is its donor's).
  std::int64_t committed_steps() const { return group_.committed_steps(); }
  ModuleT& module() { return module_; }                         ///< the wrapped module
  decltype(auto) operator->() { return module_.operator->(); }  ///< the module's members: `ft->parameters()`

 private:
  ModuleT module_;
  FaultTolerantGroup group_;
};

}  // namespace corpc::ddp
