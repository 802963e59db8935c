// The fault-tolerant trainer (see corpc/ddp/fault_tolerant.hpp): each attempt at a step asks for a quorum, rebuilds
// the group when the epoch changed (after recovering from a donor if told to), runs the caller's forward and
// backward, votes, and takes the optimizer step only once the coordinator committed it.

#include <algorithm>
#include <mutex>
#include <sstream>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "corpc/ddp/fault_tolerant.hpp"
#include "corpc/ddp/rpc_store.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"
#include "ddp/ft_member.hpp"
#include "ddp/ft_messages.hpp"
#include "ddp/process_group.hpp"

namespace corpc::ddp {

int Quorum::member_index() const {
  const int me = Runtime::get().rank();
  auto it = std::find(members.begin(), members.end(), me);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

struct FaultTolerantGroup::State {
  std::shared_ptr<ft_detail::Member> member;
  torch::nn::Module& module;
  torch::optim::Optimizer& optimizer;
  std::int64_t epoch = -1;  // of `group` and `sync`
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::unique_ptr<GradientSync> sync;

  State(torch::nn::Module& m, torch::optim::Optimizer& o, FaultTolerantOptions options)
      : member(std::make_shared<ft_detail::Member>(std::vector<ft_detail::Member::Part>{{&m, &o}}, std::move(options))),
        module(m),
        optimizer(o) {}

  // The group of `q`'s members, under the epoch's own store prefix; then DDP on it.
  void join_epoch(const Quorum& q) {
    sync.reset();
    group.reset();
    const auto& options = member->options();
    auto base = c10::make_intrusive<RpcStore>(options.coordinator_rank, options.collective_timeout);
    auto store = c10::make_intrusive<c10d::PrefixStore>("corpc/ft/epoch/" + std::to_string(q.epoch) + "/", base);
    group = detail::gloo_group(store, q.member_index(), q.member_count(), options.collective_timeout,
                               /*loopback=*/true);
    sync = std::make_unique<GradientSync>(module, group, options.ddp);
    epoch = q.epoch;
  }
};

FaultTolerantGroup::FaultTolerantGroup(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                       FaultTolerantOptions options) {
  detail::ignore_sigpipe_unless_handled();  // before any group: see its comment
  state_ = std::make_shared<State>(module, optimizer, std::move(options));
  ft_detail::register_member(state_->member);
}

FaultTolerantGroup::~FaultTolerantGroup() = default;

std::int64_t FaultTolerantGroup::committed_steps() const { return state_->member->committed(); }

GradientSync& FaultTolerantGroup::gradient_sync() {
  if (!state_->sync) throw UsageError("FaultTolerantDdp: forward() outside step()");
  return *state_->sync;
}

StepReport FaultTolerantGroup::step(const std::function<void(const Quorum&)>& fn) {
  auto& s = *state_;
  auto& member = *s.member;
  StepReport report;
  std::string error;  // an attempt's own failure
  for (int attempt = 0;; ++attempt) {
    std::vector<int> serve_to;
    Quorum q = member.ask_quorum(serve_to);  // a lost coordinator ends the training here, with its ConnectionError
    if (!member.failure_known_now().empty())
      report.last_error = ft_detail::attempt_failure(member.failure_known_now(), error);
    error.clear();
    try {
      if (q.epoch != s.epoch) {
        if (member.enter_epoch(q, serve_to)) report.recovered = true;
        s.join_epoch(q);
      }
      s.optimizer.zero_grad();
      fn(q);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::string why_not;
    if (member.vote(q, error, why_not)) {
      s.optimizer.step();
      report.quorum = std::move(q);
      report.retries = attempt;
      return report;
    }
    // Taken by nobody: a fresh group next time, and the gradients of this attempt are dropped with it.
    s.sync.reset();
    s.group.reset();
    s.epoch = -1;
    s.optimizer.zero_grad();
    report.last_error = ft_detail::attempt_failure(why_not, error);
    if (attempt >= member.options().max_retries)
      throw RpcError("FaultTolerantDdp: step " + std::to_string(q.step) + " failed " + std::to_string(attempt + 1) +
                     " times; the last: " + report.last_error);
  }
}

}  // namespace corpc::ddp
