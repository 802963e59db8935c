// The fault-tolerant DDP trainer (see corpc/ddp/fault_tolerant.hpp): what the quorum member's attempt loop
// (ft_member.hpp) asks of it. At a new epoch, a Gloo group of the members and DDP on it; an attempt zeroes the
// gradients and runs the caller's forward and backward; a committed one takes the optimizer step.

#include "corpc/ddp/fault_tolerant.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <memory>
#include <string>

#include "corpc/ddp/rpc_store.hpp"
#include "corpc/rpc/errors.hpp"

#include "ddp/ft_member.hpp"
#include "ddp/process_group.hpp"

namespace corpc::ddp {

struct FaultTolerantGroup::State final : ft_detail::Trainer {
  std::shared_ptr<ft_detail::Member> member;
  torch::nn::Module& module;
  torch::optim::Optimizer& optimizer;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::unique_ptr<GradientSync> sync;
  const std::function<void(const Quorum&)>* fn = nullptr;  // of the step() call in progress

  State(torch::nn::Module& m, torch::optim::Optimizer& o) : module(m), optimizer(o) {}

  const char* name() const override { return "FaultTolerantDdp"; }

  void leave_epoch() override {
    sync.reset();
    group.reset();
    optimizer.zero_grad();
  }

  // The group of `q`'s members, under the epoch's own store prefix; then DDP on it.
  void join_epoch(const Quorum& q) override {
    const auto& options = member->options();
    auto base = c10::make_intrusive<RpcStore>(options.coordinator_rank, options.collective_timeout);
    auto store = c10::make_intrusive<c10d::PrefixStore>("corpc/ft/epoch/" + std::to_string(q.epoch) + "/", base);
    group =
        detail::gloo_group(store, q.member_index(), q.member_count(), options.collective_timeout, detail::rpc_host());
    sync = std::make_unique<GradientSync>(module, group, options.ddp);
  }

  void run_attempt(const Quorum& q) override {
    optimizer.zero_grad();
    (*fn)(q);
  }

  void commit() override { optimizer.step(); }
};

FaultTolerantGroup::FaultTolerantGroup(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                       FaultTolerantOptions options) {
  detail::ignore_sigpipe_unless_handled();  // before any group: see its comment
  state_ = std::make_shared<State>(module, optimizer);
  state_->member = std::make_shared<ft_detail::Member>(
      state_, std::vector<ft_detail::Member::Part>{{&module, &optimizer}}, std::move(options));
  ft_detail::register_member(state_->member);
}

FaultTolerantGroup::~FaultTolerantGroup() = default;

std::int64_t FaultTolerantGroup::committed_steps() const { return state_->member->committed(); }

GradientSync& FaultTolerantGroup::gradient_sync() {
  if (!state_->sync) throw UsageError("FaultTolerantDdp: forward() outside step()");
  return *state_->sync;
}

StepReport FaultTolerantGroup::step(const std::function<void(const Quorum&)>& fn) {
  state_->fn = &fn;
  return state_->member->step();
}

}  // namespace corpc::ddp
