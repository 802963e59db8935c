// A fault-tolerant trainer's part in the quorum (see ft_member.hpp): the attempt loop with its quorum request and
// vote, the state a member serves to, and loads from, another, and the coordinator's abort passed on to the trainer.
#include "ddp/ft_member.hpp"

#include <torch/serialize.h>

#include <algorithm>

#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

#include "ddp/fault_tolerant_calls.hpp"
#include "ddp/ft_messages.hpp"
#include "ddp/optimizer_bytes.hpp"

namespace corpc::ddp {

int Quorum::member_index() const {
  const int me = Runtime::get().rank();
  auto it = std::find(members.begin(), members.end(), me);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

namespace ft_detail {

namespace {
std::mutex g_member_mutex;
std::weak_ptr<Member> g_member;
}  // namespace

void register_member(const std::shared_ptr<Member>& member) {
  std::lock_guard lock(g_member_mutex);
  if (g_member.lock()) throw UsageError("a fault-tolerant trainer trains in this process already");
  g_member = member;
}

namespace {
std::shared_ptr<Member> registered_member() {
  std::lock_guard lock(g_member_mutex);
  return g_member.lock();
}
}  // namespace

namespace {
// A call to the coordinator whose refusal of a misconfigured job is the caller's own misuse: its own type and words.
template <auto Fn, class... Args>
auto ask_coordinator(const FaultTolerantOptions& options, Args&&... args) {
  try {
    return rpc_sync<Fn>(options.coordinator_rank, with_timeout(options.quorum_timeout), std::forward<Args>(args)...);
  } catch (const RemoteError& e) {
    if (e.type() == "corpc::UsageError") throw UsageError(e.message());
    throw;
  }
}
}  // namespace

Member::Member(std::weak_ptr<Trainer> trainer, std::vector<Part> parts, FaultTolerantOptions options,
               std::vector<std::vector<int>> replica_groups)
    : trainer_(std::move(trainer)),
      parts_(std::move(parts)),
      options_(std::move(options)),
      replica_groups_(std::move(replica_groups)) {
  auto& rt = Runtime::get();
  rank_ = rt.rank();
  has_state_ = !rt.options().rejoin;
  // A job whose coordinator and trainers disagree on replica groups trains until a loss and then cannot recover:
  // refuse it now. Not where the coordinator would run in this very process: it may be made after this trainer, and
  // the first quorum request checks the same.
  if (options_.coordinator_rank != rank_) ask_coordinator<&groups_check>(options_, rank_, replica_groups_);
}

std::vector<at::Tensor> Member::tensors() const {
  std::vector<at::Tensor> all;
  for (const auto& part : parts_) {
    for (auto& p : part.module->parameters()) all.push_back(p);
    for (auto& b : part.module->buffers()) all.push_back(b);
  }
  return all;
}

// What a member that recovers from us loads: parameters and buffers, each optimizer's archive, the step counter.
std::vector<at::Tensor> Member::take_state() const {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  for (const auto& t : tensors()) out.push_back(t.detach().clone());
  for (const auto& part : parts_) out.push_back(detail::optimizer_bytes(*part.optimizer));
  out.push_back(at::tensor({committed_}, at::kLong));
  return out;
}

void Member::load_state(const std::vector<at::Tensor>& in) {
  auto mine = tensors();
  const size_t extra = parts_.size() + 1;
  if (in.size() != mine.size() + extra)
    throw UsageError("fault-tolerant training: the donor's state has " + std::to_string(in.size() - extra) +
                     " tensors, this model " + std::to_string(mine.size()) + ": the trainers run different models");
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < mine.size(); ++i) mine[i].detach().copy_(in[i]);
  for (size_t k = 0; k < parts_.size(); ++k) {
    auto archive = detail::optimizer_archive(in[mine.size() + k]);
    parts_[k].optimizer->load(archive);
  }
  committed_ = in.back().item<std::int64_t>();
}

void Member::serve_from(std::int64_t at_epoch) {
  std::vector<std::pair<Promise<std::vector<at::Tensor>>, bool>> answers;  // (reply, now or refused)
  {
    std::lock_guard lock(snapshot_mutex_);
    snapshot_ = take_state();
    snapshot_epoch_ = at_epoch;
    for (auto& [e, p] : early_requests_) answers.emplace_back(std::move(p), e == at_epoch);
    early_requests_.clear();
  }
  for (auto& [p, now] : answers) {
    if (now) {
      p.set_value(snapshot_);
    } else {
      p.set_exception(std::make_exception_ptr(
          ProtocolError("fault-tolerant training: the donor's state of that epoch is no longer there")));
    }
  }
}

Future<std::vector<at::Tensor>> Member::state_of(std::int64_t at_epoch) {
  std::lock_guard lock(snapshot_mutex_);
  if (snapshot_epoch_ == at_epoch) return make_ready_future(std::vector<at::Tensor>(snapshot_));
  if (snapshot_epoch_ > at_epoch)
    return make_exceptional_future<std::vector<at::Tensor>>(std::make_exception_ptr(
        ProtocolError("fault-tolerant training: the donor has moved past epoch " + std::to_string(at_epoch))));
  Promise<std::vector<at::Tensor>> p;
  auto f = p.get_future();
  early_requests_.emplace_back(at_epoch, std::move(p));
  return f;
}

namespace {
Quorum quorum_of(QuorumAnswer& answer, std::vector<int>& serve_to) {
  auto& [e, step, members, from, serve, failure_epoch, failure] = answer;
  serve_to = std::move(serve);
  Quorum q;
  q.epoch = e;
  q.step = step;
  q.members = std::move(members);
  q.recover_from = from;
  return q;
}
}  // namespace

Quorum Member::ask_quorum(std::vector<int>& serve_to) {
  QuorumAnswer answer =
      ask_coordinator<&quorum_request>(options_, rank_, committed_, has_state_, failed_last_, replica_groups_);
  if (failed_last_ && std::get<5>(answer) == failed_epoch_) failure_known_now_ = std::move(std::get<6>(answer));
  return quorum_of(answer, serve_to);
}

Quorum Member::next_quorum(std::vector<int>& serve_to, std::string& failed) {
  failed = std::move(next_failed_);
  next_failed_.clear();
  if (!next_) return ask_quorum(serve_to);  // a lost coordinator ends the training here, with its ConnectionError
  Quorum q = std::move(*next_);
  next_.reset();
  serve_to = std::move(next_serve_to_);
  next_serve_to_.clear();
  return q;
}

bool Member::enter_epoch(const Quorum& q, const std::vector<int>& serve_to) {
  if (!serve_to.empty()) serve_from(q.epoch);
  if (q.recover_from < 0) return false;
  load_state(rpc_sync<&state_request>(q.recover_from, with_timeout(options_.collective_timeout), q.epoch));
  has_state_ = true;
  if (options_.on_recovered) options_.on_recovered(q);
  return true;
}

bool Member::vote(const Quorum& q, const std::string& error, std::string& why_not) {
  auto [commit, why, has_next, next] = rpc_sync<&commit_and_ask>(
      options_.coordinator_rank, with_timeout(options_.quorum_timeout), rank_, q.epoch, q.step, error);
  why_not = std::move(why);
  failed_last_ = !commit;
  if (!commit) failed_epoch_ = q.epoch;
  failure_known_now_.clear();
  if (commit) committed_ = q.step + 1;
  next_.reset();
  next_serve_to_.clear();
  next_failed_.clear();
  if (commit && has_next) next_ = quorum_of(next, next_serve_to_);
  return commit;
}

void Member::enter_next_epoch(Trainer& trainer) {
  // A member that committed holds the newest state: it never recovers, but a quorum that says so is left to step().
  if (!next_ || next_->epoch == joined_epoch_ || next_->recover_from >= 0) return;
  try {
    trainer.leave_epoch();
    joined_epoch_ = -1;
    if (!next_serve_to_.empty()) serve_from(next_->epoch);
    next_serve_to_.clear();
    trainer.join_epoch(*next_);
    joined_epoch_ = next_->epoch;
  } catch (const std::exception& e) {
    next_failed_ = e.what();
  }
}

void Member::run_attempt(Trainer& trainer, const Quorum& q, const std::vector<int>& serve_to, StepReport& report,
                         std::string& error) {
  try {
    if (q.epoch != joined_epoch_) {
      trainer.leave_epoch();
      joined_epoch_ = -1;
      if (enter_epoch(q, serve_to)) report.recovered = true;
      trainer.join_epoch(q);
      joined_epoch_ = q.epoch;
    }
    trainer.run_attempt(q);
  } catch (const std::exception& e) {
    error = e.what();
  }
}

StepReport Member::step() {
  const auto trainer = trainer_.lock();
  if (!trainer) throw UsageError("fault-tolerant training: the trainer of this member is gone");
  StepReport report;
  std::string error;  // an attempt's own failure
  for (int attempt = 0;; ++attempt) {
    std::vector<int> serve_to;
    std::string entry_failed;  // the epoch of `q` could not be entered at the last commit
    Quorum q = next_quorum(serve_to, entry_failed);
    if (!failure_known_now_.empty()) report.last_error = attempt_failure(failure_known_now_, error);
    error = std::move(entry_failed);
    if (error.empty()) run_attempt(*trainer, q, serve_to, report, error);
    std::string why_not;
    if (vote(q, error, why_not)) {
      trainer->commit();
      report.quorum = std::move(q);
      report.retries = attempt;
      enter_next_epoch(*trainer);
      return report;
    }
    // Taken by nobody: fresh groups next time, and the gradients of this attempt are dropped with them.
    trainer->leave_epoch();
    joined_epoch_ = -1;
    report.last_error = attempt_failure(why_not, error);
    if (attempt >= options_.max_retries)
      throw RpcError(std::string(trainer->name()) + ": step " + std::to_string(q.step) + " failed " +
                     std::to_string(attempt + 1) + " times; the last: " + report.last_error);
  }
}

void Member::abort_attempt(std::int64_t epoch, std::int64_t step, const std::string& why) {
  if (auto trainer = trainer_.lock()) trainer->abort_attempt(epoch, step, why);
}

Future<std::vector<at::Tensor>> state_request(std::int64_t epoch) {
  const auto member = registered_member();
  if (!member)
    return make_exceptional_future<std::vector<at::Tensor>>(
        std::make_exception_ptr(UsageError("no fault-tolerant trainer trains on this worker")));
  return member->state_of(epoch);
}

void abort_attempt(std::int64_t epoch, std::int64_t step, std::string why) {
  if (const auto member = registered_member()) member->abort_attempt(epoch, step, why);
}

}  // namespace ft_detail
}  // namespace corpc::ddp

CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::state_request);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::abort_attempt);
