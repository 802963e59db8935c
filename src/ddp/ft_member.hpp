// What a fault-tolerant trainer is to the quorum, whatever it trains: its place in the committed history, the attempt
// loop of a step (ask for a quorum, enter its epoch, run, vote, then commit or leave and try again), the copy of its
// state it serves a recovering member at an epoch's boundary, and the recovery from a donor. Shared by
// FaultTolerantDdp (one part: the module and its optimizer) and pipeline replicas (a part per stage a worker hosts);
// what differs between them is a Trainer.
//
// A step costs one request to the coordinator when nothing changes: the vote carries the request for the next step's
// quorum (ft_detail::commit_and_ask), answered with the commit. A quorum answered so that begins a new epoch (a
// member recovers or joins) is entered at once, inside the step() that committed: this member serves its state and
// builds the new groups while the recovering members load it, whatever the user's code does before the next step().
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "corpc/core/future.hpp"
#include "corpc/ddp/quorum.hpp"

namespace corpc::ddp::ft_detail {

// What the attempt loop (Member::step) asks of a trainer. Every call but abort_attempt comes from step's thread.
class Trainer {
 public:
  // How the step's errors name the trainer ("FaultTolerantDdp", "PipelineReplicas").
  virtual const char* name() const = 0;
  // Off the groups of the epoch it is in: its quorum changed, or an attempt was taken by nobody (its gradients go too).
  virtual void leave_epoch() = 0;
  // Into `q`'s epoch, after this member served its state and recovered if told to: the groups of `q`'s members.
  virtual void join_epoch(const Quorum& q) = 0;
  // One attempt at `q.step`: forward, backward, averaging. Its exception is this member's failure in the vote.
  virtual void run_attempt(const Quorum& q) = 0;
  // The attempt was committed everywhere: the optimizer steps.
  virtual void commit() = 0;
  // From the coordinator, on an I/O thread: the attempt at `step` in `epoch` is taken by nobody (`why`, as
  // not_committed says it); an attempt still running stops waiting for its peers. Nothing by default.
  virtual void abort_attempt(std::int64_t /*epoch*/, std::int64_t /*step*/, const std::string& /*why*/) {}

 protected:
  ~Trainer() = default;
};

class Member {
 public:
  struct Part {
    torch::nn::Module* module;
    torch::optim::Optimizer* optimizer;
  };
  // `parts` must outlive the member. A replacement (RpcOptions::rejoin) starts without state. `replica_groups`: the
  // replicas this trainer takes part in, as the coordinator must have them (empty: a replica of its own); UsageError
  // if the coordinator's are not these. `trainer` is reached by step() and the coordinator's aborts while it lives.
  Member(std::weak_ptr<Trainer> trainer, std::vector<Part> parts, FaultTolerantOptions options,
         std::vector<std::vector<int>> replica_groups = {});

  const FaultTolerantOptions& options() const { return options_; }
  std::int64_t committed() const { return committed_; }
  // The trainer loaded the state of `step` from a checkpoint before its first step: it holds that step's state.
  void restored(std::int64_t step) {
    committed_ = step;
    has_state_ = true;
  }

  // One step: attempts until one is committed (the report says which, after how many retries, and why the last
  // failed one failed), or RpcError "NAME: step S failed N times; the last: ..." after options().max_retries
  // retries. A lost coordinator ends it with the ConnectionError of its quorum request.
  StepReport step();

  // Asked by a recovering member (ft_detail::state_request).
  Future<std::vector<at::Tensor>> state_of(std::int64_t at_epoch);
  // The coordinator's abort (ft_detail::abort_attempt), passed on to the trainer.
  void abort_attempt(std::int64_t epoch, std::int64_t step, const std::string& why);

 private:
  // The coordinator's quorum for the next attempt, answered with the last commit or asked now; `serve_to`: the members
  // that recover from this one.
  // `failed`: why entering its epoch failed at the last commit ("": it did not fail, or was not tried).
  Quorum next_quorum(std::vector<int>& serve_to, std::string& failed);
  Quorum ask_quorum(std::vector<int>& serve_to);
  // At a new epoch: the donor's side (a copy taken now, for the members in `serve_to`), then, if told to, this one's
  // recovery (true if it recovered).
  bool enter_epoch(const Quorum& q, const std::vector<int>& serve_to);
  // One attempt at `q`'s step: into its epoch if this member is not (serving, recovering, the groups), then the
  // trainer's run. Its failure goes to `error`.
  void run_attempt(Trainer& trainer, const Quorum& q, const std::vector<int>& serve_to, StepReport& report,
                   std::string& error);
  // The vote on `q`'s step, with this member's own failure ("": none). True: committed everywhere, and the step
  // counts from now on; false: `why_not` says why, naming the step, the cause and the worker it concerns.
  // Committed, the next step's quorum comes with the answer when the coordinator could form it at the commit.
  bool vote(const Quorum& q, const std::string& error, std::string& why_not);
  // A new epoch answered with the commit: entered now (see the file's comment). A failure here (a member lost before
  // its group formed) is the next attempt's: it votes that step down at once rather than wait for the group again.
  void enter_next_epoch(Trainer& trainer);

  std::vector<at::Tensor> tensors() const;
  std::vector<at::Tensor> take_state() const;
  void load_state(const std::vector<at::Tensor>& in);
  void serve_from(std::int64_t at_epoch);

  std::weak_ptr<Trainer> trainer_;
  std::vector<Part> parts_;
  FaultTolerantOptions options_;
  std::vector<std::vector<int>> replica_groups_;
  int rank_ = -1;
  std::int64_t committed_ = 0;
  bool has_state_ = true;
  bool failed_last_ = false;
  std::int64_t failed_epoch_ = -1;  // of the last attempt that was not committed
  // After a failed vote and the next quorum: why that attempt failed as the coordinator knows it now (a member lost
  // that it had not seen yet when it answered the vote), or "" if it knows no more.
  std::string failure_known_now_;
  std::int64_t joined_epoch_ = -1;  // the epoch whose groups the trainer is in (-1: none)
  std::optional<Quorum> next_;      // the next step's quorum, answered with the last commit
  std::vector<int> next_serve_to_;  // and whom this member serves in it (cleared once served)
  std::string next_failed_;         // why entering it failed, if it did ("": it did not)

  // The donor's side: the state at the boundary of `snapshot_epoch_`, and requests that came before it was taken.
  std::mutex snapshot_mutex_;
  std::int64_t snapshot_epoch_ = -1;
  std::vector<at::Tensor> snapshot_;
  std::vector<std::pair<std::int64_t, Promise<std::vector<at::Tensor>>>> early_requests_;
};

// The member of this process (one fault-tolerant trainer per process), which recovering members and the
// coordinator's aborts reach: UsageError if there is one already.
void register_member(const std::shared_ptr<Member>& member);

}  // namespace corpc::ddp::ft_detail
