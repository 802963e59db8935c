// The quorum coordinator (see corpc/ddp/fault_tolerant.hpp): each step's members and epoch, and the commit vote.
//
// One mutex guards the state; replies are completed outside it (a caller on this process may resume inline). A timer
// thread closes rounds and votes at their deadlines, and the runtime's failure listener drops a member that died.
#include <algorithm>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "corpc/core/detail/continuation.hpp"
#include "corpc/ddp/fault_tolerant.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"
#include "ddp/fault_tolerant_calls.hpp"
#include "ddp/ft_messages.hpp"

namespace corpc::ddp {

using Clock = std::chrono::steady_clock;
using ft_detail::CommitAnswer;
using ft_detail::not_committed;
using ft_detail::QuorumAnswer;
using ft_detail::worker_text;
using ft_detail::workers_text;

struct QuorumCoordinator::State {
  QuorumOptions options;
  int self_rank = -1;  // the coordinator's (kept: it may be destroyed after the runtime shut down)
  std::mutex mutex;
  std::condition_variable wake;
  std::thread timer;
  bool stopping = false;

  bool started = false;           // the first quorum has been answered
  std::int64_t epoch = 0;         // the current one (0: none yet)
  std::vector<int> members;       // of the current epoch
  std::set<int> expected;         // who a round waits for: the current members still alive (the replicas at first)
  std::int64_t broken_epoch = 0;  // a member of this epoch died: none of its steps can be committed any more
  std::string broken_cause;       // which one, and how
  // Why the last attempt that was not committed failed (QuorumAnswer): its epoch, its reason, and whether that is a
  // member's loss, which no later reason replaces.
  std::int64_t failure_epoch = -1;
  std::string failure;
  bool failure_is_loss = false;
  std::int64_t current_step = 0;  // the step of the last quorum answered
  QuorumStats stats;

  // Replica groups (QuorumOptions::replica_groups): rank -> (group, position in it). A rank in none is a group alone.
  std::map<int, std::pair<int, int>> place;
  std::vector<std::vector<int>> groups;
  bool grouped() const { return !groups.empty(); }
  std::pair<int, int> place_of(int rank) const {
    auto it = place.find(rank);
    return it == place.end() ? std::pair<int, int>{-1 - rank, 0} : it->second;
  }
  size_t group_size(int group) const { return group < 0 ? 1 : groups[static_cast<size_t>(group)].size(); }

  struct Ask {
    std::int64_t committed;
    bool has_state;
    bool failed;
    Promise<QuorumAnswer> reply;
  };
  std::map<int, Ask> round;  // the open round's requests, by rank
  // Set when the first expected rank asks (or the first rank at all, when none is expected): a rank that joins waits
  // for the members to come to their next step, and never forms a quorum of its own while they are mid-step.
  std::optional<Clock::time_point> round_deadline;
  std::int64_t global_step = 0;  // steps committed so far
  std::vector<int> holders;      // the members that committed the last of them

  using StepKey = std::pair<std::int64_t, std::int64_t>;  // (epoch, step)
  struct Vote {
    std::vector<int> voters;  // the members of the vote's epoch
    std::set<int> yes;
    std::vector<Promise<CommitAnswer>> waiting;
    Clock::time_point deadline;
  };
  std::map<StepKey, Vote> votes;    // open
  std::map<StepKey, CommitAnswer> decided;  // closed, for late voters (pruned to recent epochs)

  // Replies to complete once the mutex is released.
  struct Replies {
    std::vector<std::pair<Promise<QuorumAnswer>, QuorumAnswer>> quorums;
    std::vector<std::pair<Promise<CommitAnswer>, CommitAnswer>> votes;
    std::vector<std::pair<Promise<QuorumAnswer>, std::exception_ptr>> refusals;
    struct Abort {
      int rank;
      std::int64_t epoch, step;
      std::string why;
    };
    std::vector<Abort> aborts;  // replica groups: members told at once that their attempt is taken by nobody
    void send() {
      for (auto& [p, a] : quorums) p.set_value(std::move(a));
      for (auto& [p, v] : votes) p.set_value(v);
      for (auto& [p, e] : refusals) p.set_exception(e);
      for (auto& a : aborts) {
        try {  // best effort: a member that misses it fails its step by its own timeouts
          (void)rpc_async<&ft_detail::abort_attempt>(a.rank, a.epoch, a.step, a.why);
        } catch (const std::exception&) {
        }
      }
    }
  };

  // Closes the open round if it may: every expected rank has asked or the deadline passed, and enough replicas are
  // complete. Only whole replicas become members; the asks of a replica that misses a rank are held for a later round.
  void close_round_if_ready_locked(Clock::time_point now, Replies& out) {
    if (round.empty()) return;
    const bool all_there = std::all_of(expected.begin(), expected.end(), [&](int r) { return round.count(r) != 0; });
    if (!all_there && (!round_deadline || now < *round_deadline)) return;

    std::map<int, std::vector<int>> asked;  // group -> its ranks in the round
    for (const auto& [r, a] : round) asked[place_of(r).first].push_back(r);
    std::vector<int> now_members;
    int complete = 0;
    for (const auto& [g, ranks] : asked) {
      if (ranks.size() != group_size(g)) continue;
      ++complete;
      now_members.insert(now_members.end(), ranks.begin(), ranks.end());
    }
    if (complete < options.min_replicas) {
      round_deadline.reset();  // the next expected request starts the wait again
      return;
    }
    std::sort(now_members.begin(), now_members.end());

    std::int64_t step = 0;
    bool any_state = false, any_failed = false;
    for (int r : now_members) {
      const auto& a = round.at(r);
      any_failed = any_failed || a.failed;
      if (a.has_state) {
        step = any_state ? std::max(step, a.committed) : a.committed;
        any_state = true;
      }
    }
    // A donor per position in the replicas (every member's own, without replica groups).
    std::map<int, int> donor;
    std::vector<int> behind;
    if (any_state) {
      for (int r : now_members) {
        const auto& a = round.at(r);
        if (a.has_state && a.committed == step) donor.try_emplace(place_of(r).second, r);
      }
      for (int r : now_members)
        if (!round.at(r).has_state || round.at(r).committed < step) behind.push_back(r);
    } else {
      for (int r : now_members) step = std::max(step, round.at(r).committed);
    }
    std::string missing;  // why no member can be given the last committed state
    std::int64_t refused_step = step;
    if (global_step > 0 && (!any_state || step < global_step)) {
      refused_step = global_step;
      missing = "no live member holds the state of step " + std::to_string(global_step) + " to recover from";
      if (!holders.empty()) missing += " (it was committed by " + workers_text(holders) + ", none of which asks now)";
    }
    for (int r : behind)
      if (missing.empty() && donor.count(place_of(r).second) == 0)
        missing = "no live member at position " + std::to_string(place_of(r).second) +
                  " of a replica holds the state of step " + std::to_string(step) + " for " + worker_text(r) +
                  " to recover from";
    if (!missing.empty()) {
      // Refused, rather than restarting history.
      for (int r : now_members) {
        out.refusals.emplace_back(
            std::move(round.at(r).reply),
            std::make_exception_ptr(RpcError("fault-tolerant training: " + worker_text(r) + " cannot run step " +
                                             std::to_string(refused_step) + ": " + missing)));
        round.erase(r);
      }
      round_deadline.reset();
      return;
    }
    if (!started || now_members != members || any_failed || !behind.empty()) ++epoch;
    started = true;
    members = now_members;
    current_step = step;
    expected = std::set<int>(members.begin(), members.end());
    stats.epoch = epoch;
    ++stats.quorums;
    stats.recoveries += static_cast<std::int64_t>(behind.size());
    for (int r : members) {
      const int position = place_of(r).second;
      const bool recovers = std::find(behind.begin(), behind.end(), r) != behind.end();
      std::vector<int> serve;
      if (auto d = donor.find(position); d != donor.end() && d->second == r)
        for (int b : behind)
          if (place_of(b).second == position) serve.push_back(b);
      out.quorums.emplace_back(
          std::move(round.at(r).reply),
          QuorumAnswer{epoch, step, members, recovers ? donor.at(position) : -1, serve, failure_epoch, failure});
      round.erase(r);
    }
    round_deadline.reset();
    // Votes of older epochs can no longer be decided by anyone: they are lost.
    for (auto it = decided.begin(); it != decided.end();)
      it = it->first.first + 4 < epoch ? decided.erase(it) : std::next(it);
  }

  // Replica groups: tells `ranks` (members of the current epoch) that the step in progress is taken by nobody, so
  // that a worker waiting for a lost replica mate's activation stops now rather than at a timeout.
  void abort_members_locked(const std::vector<int>& ranks, const std::string& why, Replies& out) {
    if (!grouped()) return;
    for (int r : ranks) out.aborts.push_back({r, epoch, current_step, why});
  }

  // `cause`: why a step is not committed, naming the worker(s) it concerns (worker_text).
  void decide_locked(const StepKey& key, bool outcome, const std::string& cause, Replies& out) {
    const CommitAnswer answer{outcome, outcome ? std::string() : not_committed(key.second, cause)};
    if (!outcome && !(key.first == failure_epoch && failure_is_loss)) {
      failure_epoch = key.first;
      failure = std::get<1>(answer);
      failure_is_loss = key.first == broken_epoch && cause == broken_cause;
    }
    auto it = votes.find(key);
    if (!outcome && key.first == epoch && key.second == current_step) {
      std::vector<int> not_yes;
      for (int m : members)
        if (it == votes.end() || it->second.yes.count(m) == 0) not_yes.push_back(m);
      abort_members_locked(not_yes, std::get<1>(answer), out);
    }
    if (it != votes.end()) {
      for (auto& p : it->second.waiting) out.votes.emplace_back(std::move(p), answer);
      votes.erase(it);
    }
    if (decided.emplace(key, answer).second) ++(outcome ? stats.commits : stats.aborted_steps);
    if (outcome && key.second + 1 > global_step) {
      global_step = key.second + 1;
      if (key.first == epoch) holders = members;
    }
  }

  void expire_locked(Clock::time_point now, Replies& out) {
    close_round_if_ready_locked(now, out);
    std::vector<std::pair<StepKey, std::vector<int>>> late;  // and who did not vote
    for (const auto& [key, v] : votes) {
      if (now < v.deadline) continue;
      std::vector<int> silent;
      for (int m : v.voters)
        if (v.yes.count(m) == 0) silent.push_back(m);
      late.emplace_back(key, silent);
    }
    for (const auto& [key, silent] : late)
      decide_locked(key, false,
                    workers_text(silent) + " did not vote within the join timeout (" +
                        std::to_string(options.join_timeout.count()) + " ms)",
                    out);
  }

  Future<QuorumAnswer> ask(int rank, std::int64_t committed, bool has_state, bool failed,
                           const std::vector<std::vector<int>>& replica_groups) {
    const std::string mismatch =
        ft_detail::replica_groups_mismatch(self_rank, options.replica_groups, rank, replica_groups);
    if (!mismatch.empty()) return make_exceptional_future<QuorumAnswer>(std::make_exception_ptr(UsageError(mismatch)));
    Replies out;
    Future<QuorumAnswer> answer;
    {
      std::lock_guard lock(mutex);
      const auto now = Clock::now();
      if (!round_deadline && (expected.count(rank) != 0 || expected.empty()))
        round_deadline = now + (started ? options.join_timeout : options.startup_timeout);
      if (auto old = round.find(rank); old != round.end()) {  // asked again (its first request's caller gave up)
        out.refusals.emplace_back(std::move(old->second.reply),
                                  std::make_exception_ptr(UsageError("superseded by a newer quorum request")));
        round.erase(old);
      }
      Ask a{committed, has_state, failed, Promise<QuorumAnswer>()};
      answer = a.reply.get_future();
      round.emplace(rank, std::move(a));
      close_round_if_ready_locked(now, out);
    }
    wake.notify_all();
    out.send();
    return answer;
  }

  Future<CommitAnswer> vote(int rank, std::int64_t at_epoch, std::int64_t step, const std::string& error) {
    Replies out;
    Future<CommitAnswer> outcome;
    {
      std::lock_guard lock(mutex);
      const StepKey key{at_epoch, step};
      if (auto d = decided.find(key); d != decided.end()) return make_ready_future(CommitAnswer(d->second));
      const bool member = std::find(members.begin(), members.end(), rank) != members.end();
      if (at_epoch != epoch || !member)  // a step of a quorum that has moved on
        return make_ready_future(CommitAnswer{
            false, not_committed(step, at_epoch == broken_epoch
                                           ? broken_cause
                                           : worker_text(rank) + " voted after its quorum (epoch " +
                                                 std::to_string(at_epoch) + ") was replaced (epoch " +
                                                 std::to_string(epoch) + "): it was late past the join timeout")});
      if (!error.empty() || at_epoch == broken_epoch) {
        // A lost member first: a survivor's own failure is then most likely its consequence.
        decide_locked(key, false, at_epoch == broken_epoch ? broken_cause : worker_text(rank) + " failed it: " + error,
                      out);
        outcome = make_ready_future(CommitAnswer(decided.at(key)));
      } else {
        auto [it, fresh] = votes.try_emplace(key);
        if (fresh) {
          it->second.deadline = Clock::now() + options.join_timeout;
          it->second.voters = members;
        }
        it->second.yes.insert(rank);
        Promise<CommitAnswer> p;
        outcome = p.get_future();
        it->second.waiting.push_back(std::move(p));
        if (it->second.yes.size() == members.size()) decide_locked(key, true, "", out);
      }
    }
    wake.notify_all();
    out.send();
    return outcome;
  }

  // A rank died: no round waits for it, a vote of its epoch fails, and a request it left is dropped.
  void lost(int rank, const std::string& why) {
    Replies out;
    {
      std::lock_guard lock(mutex);
      expected.erase(rank);
      if (!round.empty() && !round_deadline) round_deadline = Clock::now() + options.join_timeout;
      if (auto a = round.find(rank); a != round.end()) {
        out.refusals.emplace_back(std::move(a->second.reply), std::make_exception_ptr(ConnectionError(why)));
        round.erase(a);
      }
      if (std::find(members.begin(), members.end(), rank) != members.end()) {
        broken_epoch = epoch;
        broken_cause = worker_text(rank) + " was lost: " + why;
        if (!(failure_epoch == epoch && failure_is_loss)) {
          failure_epoch = epoch;
          failure = not_committed(current_step, broken_cause);
          failure_is_loss = true;
        }
        std::vector<int> others;
        for (int m : members)
          if (m != rank) others.push_back(m);
        abort_members_locked(others, not_committed(current_step, broken_cause), out);
        std::vector<StepKey> open;
        for (const auto& [key, v] : votes)
          if (key.first == epoch) open.push_back(key);
        for (const auto& key : open) decide_locked(key, false, broken_cause, out);
      }
      close_round_if_ready_locked(Clock::now(), out);
    }
    out.send();
  }

  void run_timer() {
    std::unique_lock lock(mutex);
    while (!stopping) {
      auto next = Clock::now() + std::chrono::milliseconds(200);
      if (round_deadline) next = std::min(next, *round_deadline);
      for (const auto& [key, v] : votes) next = std::min(next, v.deadline);
      wake.wait_until(lock, next);
      if (stopping) break;
      Replies out;
      expire_locked(Clock::now(), out);
      lock.unlock();
      out.send();
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

QuorumCoordinator::QuorumCoordinator(QuorumOptions options) : state_(std::make_shared<State>()) {
  auto& rt = Runtime::get();
  if (options.replicas.empty() && !options.replica_groups.empty())
    for (const auto& g : options.replica_groups) options.replicas.insert(options.replicas.end(), g.begin(), g.end());
  if (options.replicas.empty())
    for (int r = 0; r < rt.world_size(); ++r)
      if (r != rt.rank()) options.replicas.push_back(r);
  if (options.min_replicas < 1) throw UsageError("QuorumOptions::min_replicas must be at least 1");
  for (size_t g = 0; g < options.replica_groups.size(); ++g) {
    const auto& ranks = options.replica_groups[g];
    if (ranks.empty() || ranks.size() != options.replica_groups[0].size())
      throw UsageError("QuorumOptions::replica_groups: every replica needs the same number of ranks (at least one)");
    for (size_t k = 0; k < ranks.size(); ++k)
      if (!state_->place.emplace(ranks[k], std::pair<int, int>{static_cast<int>(g), static_cast<int>(k)}).second)
        throw UsageError("QuorumOptions::replica_groups: rank " + std::to_string(ranks[k]) + " is in two replicas");
  }
  state_->groups = options.replica_groups;
  state_->self_rank = rt.rank();
  state_->options = std::move(options);
  state_->expected = std::set<int>(state_->options.replicas.begin(), state_->options.replicas.end());
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
  State::Replies out;
  {
    std::lock_guard lock(state_->mutex);
    for (auto& [r, a] : state_->round)
      out.refusals.emplace_back(std::move(a.reply),
                                std::make_exception_ptr(ShutdownError("the quorum coordinator has stopped")));
    state_->round.clear();
    for (auto& [key, v] : state_->votes)
      for (auto& p : v.waiting)
        out.votes.emplace_back(
            std::move(p),
            CommitAnswer{false, not_committed(key.second, "the quorum coordinator on " +
                                                              worker_text(state_->self_rank) + " has stopped")});
    state_->votes.clear();
  }
  out.send();
}

QuorumStats QuorumCoordinator::stats() const {
  std::lock_guard lock(state_->mutex);
  QuorumStats s = state_->stats;
  for (const auto& [r, a] : state_->round) s.waiting.push_back(r);
  return s;
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
        ft_detail::replica_groups_mismatch(s.self_rank, s.options.replica_groups, rank, replica_groups);
    if (!mismatch.empty()) return make_exceptional_future<bool>(std::make_exception_ptr(UsageError(mismatch)));
    return make_ready_future(true);
  });
}

Future<CommitAnswer> commit_request(int rank, std::int64_t epoch, std::int64_t step, std::string error) {
  return with_coordinator<CommitAnswer>([=](QuorumCoordinator::State& s) { return s.vote(rank, epoch, step, error); });
}

}  // namespace ft_detail
}  // namespace corpc::ddp

CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::quorum_request);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::commit_request);
CORPC_IO_THREAD_FUNCTION(&corpc::ddp::ft_detail::groups_check);
