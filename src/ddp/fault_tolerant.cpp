// The fault-tolerant trainer (see corpc/ddp/fault_tolerant.hpp): each attempt at a step asks for a quorum, rebuilds
// the group when the epoch changed (after recovering from a donor if told to), runs the caller's forward and
// backward, votes, and takes the optimizer step only once the coordinator committed it.

#include <algorithm>
#include <mutex>
#include <sstream>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/serialize.h>

#include "corpc/ddp/fault_tolerant.hpp"
#include "corpc/ddp/rpc_store.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"
#include "ddp/fault_tolerant_calls.hpp"
#include "ddp/process_group.hpp"

namespace corpc::ddp {

int Quorum::member_index() const {
  const int me = Runtime::get().rank();
  auto it = std::find(members.begin(), members.end(), me);
  return it == members.end() ? -1 : static_cast<int>(it - members.begin());
}

struct FaultTolerantGroup::State {
  torch::nn::Module& module;
  torch::optim::Optimizer& optimizer;
  FaultTolerantOptions options;
  int rank = -1;

  std::int64_t committed = 0;
  bool has_state = true;  // false in a replacement until it has recovered
  bool failed_last = false;
  std::int64_t epoch = -1;  // of `group` and `sync`
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  std::unique_ptr<GradientSync> sync;

  // The donor's side: the state at the boundary of `snapshot_epoch`, and requests that came before it was taken.
  std::mutex snapshot_mutex;
  std::int64_t snapshot_epoch = -1;
  std::vector<at::Tensor> snapshot;
  std::vector<std::pair<std::int64_t, Promise<std::vector<at::Tensor>>>> early_requests;

  State(torch::nn::Module& m, torch::optim::Optimizer& o) : module(m), optimizer(o) {}

  std::vector<at::Tensor> tensors() const {
    auto all = module.parameters();
    for (auto& b : module.buffers()) all.push_back(b);
    return all;
  }

  // What a member that recovers from us loads: parameters, buffers, the optimizer's archive, the step counter.
  std::vector<at::Tensor> take_state() const {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> out;
    for (const auto& t : tensors()) out.push_back(t.detach().clone());
    torch::serialize::OutputArchive archive;
    optimizer.save(archive);
    std::ostringstream bytes;
    archive.save_to(bytes);
    const std::string b = bytes.str();
    out.push_back(at::empty({static_cast<std::int64_t>(b.size())}, at::kByte));
    std::memcpy(out.back().data_ptr(), b.data(), b.size());
    out.push_back(at::tensor({committed}, at::kLong));
    return out;
  }

  void load_state(const std::vector<at::Tensor>& in) {
    auto mine = tensors();
    if (in.size() != mine.size() + 2)
      throw UsageError("FaultTolerantDdp: the donor's state has " + std::to_string(in.size() - 2) +
                       " tensors, this model " + std::to_string(mine.size()) + ": the trainers run different models");
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < mine.size(); ++i) mine[i].detach().copy_(in[i]);
    const auto& bytes = in[mine.size()];
    std::istringstream stream(std::string(static_cast<const char*>(bytes.data_ptr()), bytes.numel()));
    torch::serialize::InputArchive archive;
    archive.load_from(stream);
    optimizer.load(archive);
    committed = in.back().item<std::int64_t>();
  }

  void serve_from(std::int64_t at_epoch) {
    std::vector<std::pair<Promise<std::vector<at::Tensor>>, bool>> answers;  // (reply, now or refused)
    {
      std::lock_guard lock(snapshot_mutex);
      snapshot = take_state();
      snapshot_epoch = at_epoch;
      for (auto& [e, p] : early_requests) answers.emplace_back(std::move(p), e == at_epoch);
      early_requests.clear();
    }
    for (auto& [p, now] : answers) {
      if (now) {
        p.set_value(snapshot);
      } else {
        p.set_exception(std::make_exception_ptr(
            ProtocolError("FaultTolerantDdp: the donor's state of that epoch is no longer there")));
      }
    }
  }

  Future<std::vector<at::Tensor>> state_of(std::int64_t at_epoch) {
    std::lock_guard lock(snapshot_mutex);
    if (snapshot_epoch == at_epoch) return make_ready_future(std::vector<at::Tensor>(snapshot));
    if (snapshot_epoch > at_epoch)
      return make_exceptional_future<std::vector<at::Tensor>>(std::make_exception_ptr(
          ProtocolError("FaultTolerantDdp: the donor has moved past epoch " + std::to_string(at_epoch))));
    Promise<std::vector<at::Tensor>> p;
    auto f = p.get_future();
    early_requests.emplace_back(at_epoch, std::move(p));
    return f;
  }

  Quorum ask_quorum(std::vector<int>& serve_to) {
    auto [e, step, members, from, serve] = rpc_sync<&ft_detail::quorum_request>(
        options.coordinator_rank, with_timeout(options.quorum_timeout), rank, committed, has_state, failed_last);
    serve_to = std::move(serve);
    Quorum q;
    q.epoch = e;
    q.step = step;
    q.members = std::move(members);
    q.recover_from = from;
    return q;
  }

  // The group of `q`'s members, under the epoch's own store prefix; then DDP on it.
  void join_epoch(const Quorum& q) {
    sync.reset();
    group.reset();
    auto base = c10::make_intrusive<RpcStore>(options.coordinator_rank, options.collective_timeout);
    auto store = c10::make_intrusive<c10d::PrefixStore>("corpc/ft/epoch/" + std::to_string(q.epoch) + "/", base);
    group = detail::gloo_group(store, q.member_index(), q.member_count(), options.collective_timeout,
                               /*loopback=*/true);
    sync = std::make_unique<GradientSync>(module, group, options.ddp);
    epoch = q.epoch;
  }
};

namespace {

std::mutex g_trainer_mutex;
std::weak_ptr<FaultTolerantGroup::State> g_trainer;

}  // namespace

FaultTolerantGroup::FaultTolerantGroup(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                       FaultTolerantOptions options)
    : state_(std::make_shared<State>(module, optimizer)) {
  auto& rt = Runtime::get();
  detail::ignore_sigpipe_unless_handled();  // before any group: see its comment
  state_->options = std::move(options);
  state_->rank = rt.rank();
  state_->has_state = !rt.options().rejoin;
  std::lock_guard lock(g_trainer_mutex);
  if (g_trainer.lock()) throw UsageError("a FaultTolerantDdp trains in this process already");
  g_trainer = state_;
}

FaultTolerantGroup::~FaultTolerantGroup() = default;

std::int64_t FaultTolerantGroup::committed_steps() const { return state_->committed; }

GradientSync& FaultTolerantGroup::gradient_sync() {
  if (!state_->sync) throw UsageError("FaultTolerantDdp: forward() outside step()");
  return *state_->sync;
}

StepReport FaultTolerantGroup::step(const std::function<void(const Quorum&)>& fn) {
  auto& s = *state_;
  StepReport report;
  for (int attempt = 0;; ++attempt) {
    std::vector<int> serve_to;
    Quorum q = s.ask_quorum(serve_to);  // a lost coordinator ends the training here, with its ConnectionError
    bool ok = true;
    try {
      if (q.epoch != s.epoch) {
        if (!serve_to.empty()) s.serve_from(q.epoch);
        if (q.recover_from >= 0) {
          auto state =
              rpc_sync<&ft_detail::state_request>(q.recover_from, with_timeout(s.options.collective_timeout), q.epoch);
          s.load_state(state);
          s.has_state = true;
          report.recovered = true;
          if (s.options.on_recovered) s.options.on_recovered(q);
        }
        s.join_epoch(q);
      }
      s.optimizer.zero_grad();
      fn(q);
    } catch (const std::exception& e) {
      ok = false;
      report.last_error = e.what();
    }
    const bool commit = rpc_sync<&ft_detail::commit_request>(
        s.options.coordinator_rank, with_timeout(s.options.quorum_timeout), s.rank, q.epoch, q.step, ok);
    if (commit) {
      s.optimizer.step();
      s.committed = q.step + 1;
      s.failed_last = false;
      report.quorum = std::move(q);
      report.retries = attempt;
      return report;
    }
    // Taken by nobody: a fresh group next time, and the gradients of this attempt are dropped with it.
    s.failed_last = true;
    s.sync.reset();
    s.group.reset();
    s.epoch = -1;
    s.optimizer.zero_grad();
    if (attempt >= s.options.max_retries)
      throw RpcError("FaultTolerantDdp: step " + std::to_string(q.step) + " failed " + std::to_string(attempt + 1) +
                     " times; the last: " + (report.last_error.empty() ? "not committed" : report.last_error));
    if (report.last_error.empty()) report.last_error = "step " + std::to_string(q.step) + " was not committed";
  }
}

namespace ft_detail {

Future<std::vector<at::Tensor>> state_request(std::int64_t epoch) {
  std::shared_ptr<FaultTolerantGroup::State> trainer;
  {
    std::lock_guard lock(g_trainer_mutex);
    trainer = g_trainer.lock();
  }
  if (!trainer)
    return make_exceptional_future<std::vector<at::Tensor>>(
        std::make_exception_ptr(UsageError("no FaultTolerantDdp trains on this worker")));
  return trainer->state_of(epoch);
}

}  // namespace ft_detail
}  // namespace corpc::ddp

CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::state_request);
