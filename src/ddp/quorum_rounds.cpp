// The quorum coordinator's rounds and votes (see quorum_rounds.hpp).
#include "ddp/quorum_rounds.hpp"

#include <algorithm>
#include <iterator>

#include "corpc/rpc/errors.hpp"

#include "ddp/ft_messages.hpp"

namespace corpc::ddp::ft_detail {

void Outbox::complete_replies() {
  for (auto& [p, a] : quorums) p.set_value(std::move(a));
  for (auto& [p, v] : votes) p.set_value(v);
  for (auto& [p, e] : refusals) p.set_exception(e);
}

QuorumRounds::QuorumRounds(QuorumOptions options) : options_(std::move(options)) {
  for (size_t g = 0; g < options_.replica_groups.size(); ++g) {
    const auto& ranks = options_.replica_groups[g];
    if (ranks.empty() || ranks.size() != options_.replica_groups[0].size())
      throw UsageError("QuorumOptions::replica_groups: every replica needs the same number of ranks (at least one)");
    for (size_t k = 0; k < ranks.size(); ++k)
      if (!place_.emplace(ranks[k], std::pair<int, int>{static_cast<int>(g), static_cast<int>(k)}).second)
        throw UsageError("QuorumOptions::replica_groups: rank " + std::to_string(ranks[k]) + " is in two replicas");
  }
  groups_ = options_.replica_groups;
  expected_ = std::set<int>(options_.replicas.begin(), options_.replicas.end());
}

std::pair<int, int> QuorumRounds::place_of(int rank) const {
  auto it = place_.find(rank);
  return it == place_.end() ? std::pair<int, int>{-1 - rank, 0} : it->second;
}

size_t QuorumRounds::group_size(int group) const { return group < 0 ? 1 : groups_[static_cast<size_t>(group)].size(); }

// ---- rounds ----

bool QuorumRounds::round_may_close(Clock::time_point now) const {
  if (round_.empty()) return false;
  const bool all_there = std::all_of(expected_.begin(), expected_.end(), [&](int r) { return round_.count(r) != 0; });
  return all_there || (round_deadline_ && now >= *round_deadline_);
}

std::vector<int> QuorumRounds::complete_replicas(int& count) const {
  std::map<int, std::vector<int>> asked;  // group -> its ranks in the round
  for (const auto& [r, a] : round_) asked[place_of(r).first].push_back(r);
  std::vector<int> ranks;
  count = 0;
  for (const auto& [g, in_round] : asked) {
    if (in_round.size() != group_size(g)) continue;
    ++count;
    ranks.insert(ranks.end(), in_round.begin(), in_round.end());
  }
  std::sort(ranks.begin(), ranks.end());
  return ranks;
}

QuorumRounds::Holdings QuorumRounds::holdings_of(const std::vector<int>& members) const {
  Holdings h;
  for (int r : members) {
    const auto& a = round_.at(r);
    h.any_failed = h.any_failed || a.failed;
    if (a.has_state) {
      h.step = h.any_state ? std::max(h.step, a.committed) : a.committed;
      h.any_state = true;
    }
  }
  if (!h.any_state) {  // nobody holds state: the count of the furthest, and no recovery
    for (int r : members) h.step = std::max(h.step, round_.at(r).committed);
    return h;
  }
  // A donor per position in the replicas (every member's own, without replica groups).
  for (int r : members) {
    const auto& a = round_.at(r);
    if (a.has_state && a.committed == h.step) h.donor.try_emplace(place_of(r).second, r);
  }
  for (int r : members)
    if (!round_.at(r).has_state || round_.at(r).committed < h.step) h.behind.push_back(r);
  return h;
}

std::string QuorumRounds::missing_state(const Holdings& h, std::int64_t& refused_step) const {
  refused_step = h.step;
  if (global_step_ > 0 && (!h.any_state || h.step < global_step_)) {
    refused_step = global_step_;
    std::string missing = "no live member holds the state of step " + std::to_string(global_step_) + " to recover from";
    if (!holders_.empty()) missing += " (it was committed by " + workers_text(holders_) + ", none of which asks now)";
    return missing;
  }
  for (int r : h.behind)
    if (h.donor.count(place_of(r).second) == 0)
      return "no live member at position " + std::to_string(place_of(r).second) +
             " of a replica holds the state of step " + std::to_string(h.step) + " for " + worker_text(r) +
             " to recover from";
  return {};
}

void QuorumRounds::refuse_round(const std::vector<int>& members, std::int64_t step, const std::string& missing,
                                Outbox& out) {
  for (int r : members) {
    out.refusals.emplace_back(
        std::move(round_.at(r).reply),
        std::make_exception_ptr(RpcError("fault-tolerant training: " + worker_text(r) + " cannot run step " +
                                         std::to_string(step) + ": " + missing)));
    round_.erase(r);
  }
  round_deadline_.reset();
}

void QuorumRounds::open_epoch(const std::vector<int>& members, const Holdings& h, Outbox& out) {
  if (!started_ || members != members_ || h.any_failed || !h.behind.empty()) ++epoch_;
  started_ = true;
  members_ = members;
  current_step_ = h.step;
  expected_ = std::set<int>(members_.begin(), members_.end());
  stats_.epoch = epoch_;
  ++stats_.quorums;
  stats_.recoveries += static_cast<std::int64_t>(h.behind.size());
  for (int r : members_) {
    const int position = place_of(r).second;
    const bool recovers = std::find(h.behind.begin(), h.behind.end(), r) != h.behind.end();
    std::vector<int> serve;
    if (auto d = h.donor.find(position); d != h.donor.end() && d->second == r)
      for (int b : h.behind)
        if (place_of(b).second == position) serve.push_back(b);
    out.quorums.emplace_back(
        std::move(round_.at(r).reply),
        QuorumAnswer{epoch_, h.step, members_, recovers ? h.donor.at(position) : -1, serve, failure_epoch_, failure_});
    round_.erase(r);
  }
  round_deadline_.reset();
  // Votes of older epochs can no longer be decided by anyone: they are lost.
  for (auto it = decided_.begin(); it != decided_.end();)
    it = it->first.first + 4 < epoch_ ? decided_.erase(it) : std::next(it);
}

void QuorumRounds::close_round_if_ready(Clock::time_point now, Outbox& out) {
  if (!round_may_close(now)) return;
  int complete = 0;
  const std::vector<int> members = complete_replicas(complete);
  if (complete < options_.min_replicas) {
    round_deadline_.reset();  // the next expected request starts the wait again
    return;
  }
  const Holdings h = holdings_of(members);
  std::int64_t refused_step = 0;
  if (const std::string missing = missing_state(h, refused_step); !missing.empty())
    refuse_round(members, refused_step, missing, out);  // rather than restarting history
  else open_epoch(members, h, out);
}

Future<QuorumAnswer> QuorumRounds::ask(int rank, std::int64_t committed, bool has_state, bool failed,
                                       Clock::time_point now, Outbox& out) {
  if (!round_deadline_ && (expected_.count(rank) != 0 || expected_.empty()))
    round_deadline_ = now + (started_ ? options_.join_timeout : options_.startup_timeout);
  if (auto old = round_.find(rank); old != round_.end()) {  // asked again (its first request's caller gave up)
    out.refusals.emplace_back(std::move(old->second.reply),
                              std::make_exception_ptr(UsageError("superseded by a newer quorum request")));
    round_.erase(old);
  }
  Ask a{committed, has_state, failed, Promise<QuorumAnswer>()};
  auto answer = a.reply.get_future();
  round_.emplace(rank, std::move(a));
  close_round_if_ready(now, out);
  return answer;
}

// ---- votes ----

void QuorumRounds::abort_members(const std::vector<int>& ranks, const std::string& why, Outbox& out) {
  if (!grouped()) return;
  for (int r : ranks) out.aborts.push_back({r, epoch_, current_step_, why});
}

void QuorumRounds::decide(const StepKey& key, bool outcome, const std::string& cause, Outbox& out) {
  const CommitAnswer answer{outcome, outcome ? std::string() : not_committed(key.second, cause)};
  if (!outcome && !(key.first == failure_epoch_ && failure_is_loss_)) {
    failure_epoch_ = key.first;
    failure_ = std::get<1>(answer);
    failure_is_loss_ = key.first == broken_epoch_ && cause == broken_cause_;
  }
  auto it = votes_.find(key);
  if (!outcome && key.first == epoch_ && key.second == current_step_) {
    std::vector<int> not_yes;
    for (int m : members_)
      if (it == votes_.end() || it->second.yes.count(m) == 0) not_yes.push_back(m);
    abort_members(not_yes, std::get<1>(answer), out);
  }
  if (it != votes_.end()) {
    for (auto& p : it->second.waiting) out.votes.emplace_back(std::move(p), answer);
    votes_.erase(it);
  }
  if (decided_.emplace(key, answer).second) ++(outcome ? stats_.commits : stats_.aborted_steps);
  if (outcome && key.second + 1 > global_step_) {
    global_step_ = key.second + 1;
    if (key.first == epoch_) holders_ = members_;
  }
}

Future<CommitAnswer> QuorumRounds::vote(int rank, std::int64_t at_epoch, std::int64_t step, const std::string& error,
                                        Clock::time_point now, Outbox& out) {
  const StepKey key{at_epoch, step};
  if (auto d = decided_.find(key); d != decided_.end()) return make_ready_future(CommitAnswer(d->second));
  const bool member = std::find(members_.begin(), members_.end(), rank) != members_.end();
  if (at_epoch != epoch_ || !member)  // a step of a quorum that has moved on
    return make_ready_future(CommitAnswer{
        false, not_committed(step, at_epoch == broken_epoch_
                                       ? broken_cause_
                                       : worker_text(rank) + " voted after its quorum (epoch " +
                                             std::to_string(at_epoch) + ") was replaced (epoch " +
                                             std::to_string(epoch_) + "): it was late past the join timeout")});
  if (!error.empty() || at_epoch == broken_epoch_) {
    // A lost member first: a survivor's own failure is then most likely its consequence.
    decide(key, false, at_epoch == broken_epoch_ ? broken_cause_ : worker_text(rank) + " failed it: " + error, out);
    return make_ready_future(CommitAnswer(decided_.at(key)));
  }
  auto [it, fresh] = votes_.try_emplace(key);
  if (fresh) {
    it->second.deadline = now + options_.join_timeout;
    it->second.voters = members_;
  }
  it->second.yes.insert(rank);
  Promise<CommitAnswer> p;
  auto outcome = p.get_future();
  it->second.waiting.push_back(std::move(p));
  if (it->second.yes.size() == members_.size()) decide(key, true, "", out);
  return outcome;
}

void QuorumRounds::lost(int rank, const std::string& why, Clock::time_point now, Outbox& out) {
  expected_.erase(rank);
  if (!round_.empty() && !round_deadline_) round_deadline_ = now + options_.join_timeout;
  if (auto a = round_.find(rank); a != round_.end()) {
    out.refusals.emplace_back(std::move(a->second.reply), std::make_exception_ptr(ConnectionError(why)));
    round_.erase(a);
  }
  if (std::find(members_.begin(), members_.end(), rank) != members_.end()) {
    broken_epoch_ = epoch_;
    broken_cause_ = worker_text(rank) + " was lost: " + why;
    if (!(failure_epoch_ == epoch_ && failure_is_loss_)) {
      failure_epoch_ = epoch_;
      failure_ = not_committed(current_step_, broken_cause_);
      failure_is_loss_ = true;
    }
    std::vector<int> others;
    for (int m : members_)
      if (m != rank) others.push_back(m);
    abort_members(others, not_committed(current_step_, broken_cause_), out);
    std::vector<StepKey> open;
    for (const auto& [key, v] : votes_)
      if (key.first == epoch_) open.push_back(key);
    for (const auto& key : open) decide(key, false, broken_cause_, out);
  }
  close_round_if_ready(now, out);
}

void QuorumRounds::expire(Clock::time_point now, Outbox& out) {
  close_round_if_ready(now, out);
  std::vector<std::pair<StepKey, std::vector<int>>> late;  // and who did not vote
  for (const auto& [key, v] : votes_) {
    if (now < v.deadline) continue;
    std::vector<int> silent;
    for (int m : v.voters)
      if (v.yes.count(m) == 0) silent.push_back(m);
    late.emplace_back(key, silent);
  }
  for (const auto& [key, silent] : late)
    decide(key, false,
           workers_text(silent) + " did not vote within the join timeout (" +
               std::to_string(options_.join_timeout.count()) + " ms)",
           out);
}

std::optional<QuorumRounds::Clock::time_point> QuorumRounds::next_deadline() const {
  std::optional<Clock::time_point> next = round_deadline_;
  for (const auto& [key, v] : votes_)
    if (!next || v.deadline < *next) next = v.deadline;
  return next;
}

void QuorumRounds::stop(const std::string& why, Outbox& out) {
  for (auto& [r, a] : round_)
    out.refusals.emplace_back(std::move(a.reply),
                              std::make_exception_ptr(ShutdownError("the quorum coordinator has stopped")));
  round_.clear();
  for (auto& [key, v] : votes_)
    for (auto& p : v.waiting) out.votes.emplace_back(std::move(p), CommitAnswer{false, not_committed(key.second, why)});
  votes_.clear();
}

QuorumStats QuorumRounds::stats() const {
  QuorumStats s = stats_;
  for (const auto& [r, a] : round_) s.waiting.push_back(r);
  return s;
}

}  // namespace corpc::ddp::ft_detail
