// The quorum coordinator (see corpc/ddp/quorum.hpp) on its rank: the requests of fault_tolerant_calls.hpp, answered
// by its rounds (quorum_rounds.hpp, which decide each step's members and epoch, and the commit vote).
//
// One mutex guards the rounds; replies are completed outside it (a caller on this process may resume inline). A timer
// thread closes rounds and votes at their deadlines, and the runtime's failure listener drops a member that died.
#include <algorithm>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "corpc/core/detail/continuation.hpp"
#include "corpc/ddp/quorum.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

#include "ddp/fault_tolerant_calls.hpp"
#include "ddp/ft_messages.hpp"
#include "ddp/quorum_rounds.hpp"

namespace corpc::ddp {

using ft_detail::CommitAnswer;
using ft_detail::Outbox;
using ft_detail::QuorumAnswer;
using ft_detail::VoteAnswer;
using Clock = ft_detail::QuorumClock;

struct QuorumCoordinator::State {
  ft_detail::QuorumRounds rounds;  // guarded by `mutex`
  const int self_rank;             // the coordinator's (kept: it may be destroyed after the runtime shut down)
  mutable std::mutex mutex;
  std::condition_variable wake;
  std::thread timer;
  bool stopping = false;

  State(QuorumOptions options, int rank) : rounds(std::move(options)), self_rank(rank) {}

  // What `out` holds, once the mutex is released: replies first, then the aborts to members.
  static void send(Outbox& out) {
    out.complete_replies();
    for (auto& a : out.aborts) {
      try {  // best effort: a member that misses it fails its step by its own timeouts
        (void)rpc_async<&ft_detail::abort_attempt>(a.rank, a.epoch, a.step, a.why);
      } catch (const std::exception&) {}
    }
  }

  // A request to the rounds under the mutex; then the timer wakes for any new deadline, and the outbox is sent.
  template <class Request>
  auto under_lock(Request request) {
    Outbox out;
    decltype(request(Clock::now(), out)) answer;
    {
      std::lock_guard lock(mutex);
      answer = request(Clock::now(), out);
    }
    wake.notify_all();
    send(out);
    return answer;
  }

  Future<QuorumAnswer> ask(int rank, std::int64_t committed, bool has_state, bool failed,
                           const std::vector<std::vector<int>>& replica_groups) {
    const std::string mismatch =
        ft_detail::replica_groups_mismatch(self_rank, rounds.options().replica_groups, rank, replica_groups);
    if (!mismatch.empty()) return make_exceptional_future<QuorumAnswer>(std::make_exception_ptr(UsageError(mismatch)));
    return under_lock(
        [&](Clock::time_point now, Outbox& out) { return rounds.ask(rank, committed, has_state, failed, now, out); });
  }

  Future<CommitAnswer> vote(int rank, std::int64_t at_epoch, std::int64_t step, const std::string& error) {
    return under_lock(
        [&](Clock::time_point now, Outbox& out) { return rounds.vote(rank, at_epoch, step, error, now, out); });
  }

  Future<VoteAnswer> vote_and_ask(int rank, std::int64_t at_epoch, std::int64_t step, const std::string& error) {
    return under_lock(
        [&](Clock::time_point now, Outbox& out) { return rounds.vote_and_ask(rank, at_epoch, step, error, now, out); });
  }

  void lost(int rank, const std::string& why) {
    Outbox out;
    {
      std::lock_guard lock(mutex);
      rounds.lost(rank, why, Clock::now(), out);
    }
    send(out);
  }

  // Closes rounds and votes at their deadlines; wakes at least every 200 ms.
  void run_timer() {
    std::unique_lock lock(mutex);
    while (!stopping) {
      auto next = Clock::now() + std::chrono::milliseconds(200);
      if (auto due = rounds.next_deadline()) next = std::min(next, *due);
      wake.wait_until(lock, next);
      if (stopping) break;
      Outbox out;
      rounds.expire(Clock::now(), out);
      lock.unlock();
      send(out);
      lock.lock();
    }
  }
};

namespace {

// The coordinator of this process, and requests that came before it was constructed (trainers may ask as soon as
// init_rpc returns on their side): they wait for it, bounded by their callers' timeouts.
std::mutex g_coordinator_mutex;
std::weak_ptr<QuorumCoordinator::State> g_coordinator;
std::vector<std::function<void(QuorumCoordinator::State&)>> g_early;

template <class T>
Future<T> with_coordinator(std::function<Future<T>(QuorumCoordinator::State&)> request) {
  std::shared_ptr<QuorumCoordinator::State> c;
  {
    std::lock_guard lock(g_coordinator_mutex);
    c = g_coordinator.lock();
    if (!c) {
      Promise<T> p;
      auto f = p.get_future();
      g_early.push_back([request = std::move(request),
                         p = std::make_shared<Promise<T>>(std::move(p))](QuorumCoordinator::State& s) mutable {
        auto r = request(s);
        corpc::detail::on_ready_inline(r, [p, r] {
          try {
            p->set_value(r.value());
          } catch (...) {
            p->set_exception(std::current_exception());
          }
        });
      });
      return f;
    }
  }
  return request(*c);
}

}  // namespace

QuorumCoordinator::QuorumCoordinator(QuorumOptions options) {
  auto& rt = Runtime::get();
  if (options.replicas.empty() && !options.replica_groups.empty())
    for (const auto& g : options.replica_groups) options.replicas.insert(options.replicas.end(), g.begin(), g.end());
  if (options.replicas.empty())
    for (int r = 0; r < rt.world_size(); ++r)
      if (r != rt.rank()) options.replicas.push_back(r);
  if (options.min_replicas < 1) throw UsageError("QuorumOptions::min_replicas must be at least 1");
  state_ = std::make_shared<State>(std::move(options), rt.rank());
  std::vector<std::function<void(State&)>> early;
  {
    std::lock_guard lock(g_coordinator_mutex);
    if (g_coordinator.lock()) throw UsageError("a QuorumCoordinator runs in this process already");
    g_coordinator = state_;
    early.swap(g_early);
  }
  std::weak_ptr<State> weak = state_;
  rt.add_peer_failure_listener([weak](int rank, const std::string& why) {
    if (auto s = weak.lock()) s->lost(rank, why);
  });
  state_->timer = std::thread([s = state_.get()] { s->run_timer(); });
  for (auto& request : early) request(*state_);
}

QuorumCoordinator::~QuorumCoordinator() {
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->wake.notify_all();
  state_->timer.join();
  Outbox out;
  {
    std::lock_guard lock(state_->mutex);
    state_->rounds.stop("the quorum coordinator on " + ft_detail::worker_text(state_->self_rank) + " has stopped", out);
  }
  State::send(out);
}

QuorumStats QuorumCoordinator::stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->rounds.stats();
}

namespace ft_detail {

Future<QuorumAnswer> quorum_request(int rank, std::int64_t committed, bool has_state, bool failed,
                                    std::vector<std::vector<int>> replica_groups) {
  return with_coordinator<QuorumAnswer>(
      [=](QuorumCoordinator::State& s) { return s.ask(rank, committed, has_state, failed, replica_groups); });
}

Future<bool> groups_check(int rank, std::vector<std::vector<int>> replica_groups) {
  return with_coordinator<bool>([=](QuorumCoordinator::State& s) {
    const std::string mismatch =
        ft_detail::replica_groups_mismatch(s.self_rank, s.rounds.options().replica_groups, rank, replica_groups);
    if (!mismatch.empty()) return make_exceptional_future<bool>(std::make_exception_ptr(UsageError(mismatch)));
    return make_ready_future(true);
  });
}

Future<CommitAnswer> commit_request(int rank, std::int64_t epoch, std::int64_t step, std::string error) {
  return with_coordinator<CommitAnswer>([=](QuorumCoordinator::State& s) { return s.vote(rank, epoch, step, error); });
}

Future<VoteAnswer> commit_and_ask(int rank, std::int64_t epoch, std::int64_t step, std::string error) {
  return with_coordinator<VoteAnswer>(
      [=](QuorumCoordinator::State& s) { return s.vote_and_ask(rank, epoch, step, error); });
}

}  // namespace ft_detail
}  // namespace corpc::ddp

CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::quorum_request);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::commit_request);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::commit_and_ask);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::groups_check);
