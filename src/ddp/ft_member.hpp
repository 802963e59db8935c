// What a fault-tolerant trainer is to the quorum, whatever it trains: its place in the committed history, the copy of
// its state it serves a recovering member at an epoch's boundary, and the recovery from a donor. Shared by
// FaultTolerantDdp (one part: the module and its optimizer) and pipeline replicas (a part per stage a worker hosts).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "corpc/core/future.hpp"
#include "corpc/ddp/fault_tolerant.hpp"

namespace corpc::ddp::ft_detail {

class Member {
 public:
  struct Part {
    torch::nn::Module* module;
    torch::optim::Optimizer* optimizer;
  };
  // `parts` must outlive the member. A replacement (RpcOptions::rejoin) starts without state. `replica_groups`: the
  // replicas this trainer takes part in, as the coordinator must have them (empty: a replica of its own).
  Member(std::vector<Part> parts, FaultTolerantOptions options, std::vector<std::vector<int>> replica_groups = {});

  const FaultTolerantOptions& options() const { return options_; }
  int rank() const { return rank_; }
  std::int64_t committed() const { return committed_; }

  // The coordinator's quorum for the next attempt; `serve_to`: the members that recover from this one. UsageError if
  // the coordinator's replica groups are not this trainer's.
  Quorum ask_quorum(std::vector<int>& serve_to);
  // At a new epoch: the donor's side (a copy taken now, for the members in `serve_to`), then, if told to, this one's
  // recovery (true if it recovered).
  bool enter_epoch(const Quorum& q, const std::vector<int>& serve_to);
  // The vote on `q`'s step, with this member's own failure ("": none). True: committed everywhere, and the step
  // counts from now on; false: `why_not` says why, naming the step, the cause and the worker it concerns.
  bool vote(const Quorum& q, const std::string& error, std::string& why_not);
  // After a failed vote and the next quorum: why that attempt failed as the coordinator knows it now (a member lost
  // that it had not seen yet when it answered the vote), or "" if it knows no more.
  const std::string& failure_known_now() const { return failure_known_now_; }

  // Asked by a recovering member (ft_detail::state_request).
  Future<std::vector<at::Tensor>> state_of(std::int64_t at_epoch);

 private:
  std::vector<at::Tensor> tensors() const;
  std::vector<at::Tensor> take_state() const;
  void load_state(const std::vector<at::Tensor>& in);
  void serve_from(std::int64_t at_epoch);

  std::vector<Part> parts_;
  FaultTolerantOptions options_;
  std::vector<std::vector<int>> replica_groups_;
  int rank_ = -1;
  std::int64_t committed_ = 0;
  bool has_state_ = true;
  bool failed_last_ = false;
  std::int64_t failed_epoch_ = -1;  // of the last attempt that was not committed
  std::string failure_known_now_;

  // The donor's side: the state at the boundary of `snapshot_epoch_`, and requests that came before it was taken.
  std::mutex snapshot_mutex_;
  std::int64_t snapshot_epoch_ = -1;
  std::vector<at::Tensor> snapshot_;
  std::vector<std::pair<std::int64_t, Promise<std::vector<at::Tensor>>>> early_requests_;
};

// The member of this process (one fault-tolerant trainer per process): UsageError if there is one already.
void register_member(const std::shared_ptr<Member>& member);

}  // namespace corpc::ddp::ft_detail
