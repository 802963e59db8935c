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
  for (auto& [p, v] : vote_answers) p.set_value(std::move(v));
}

void QuorumRounds::answer(Ask& a, QuorumAnswer q, Outbox& out) {
  if (a.with_vote) out.vote_answers.emplace_back(std::move(*a.with_vote), VoteAnswer{true, "", true, std::move(q)});
  else out.quorums.emplace_back(std::move(a.reply), std::move(q));
}

void QuorumRounds::refuse(Ask& a, std::exception_ptr e, Outbox& out) {
  if (a.with_vote) out.vote_answers.emplace_back(std::move(*a.with_vote), VoteAnswer{true, "", false, {}});
  else out.refusals.emplace_back(std::move(a.reply), std::move(e));
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
    refuse(round_.at(r),
           std::make_exception_ptr(RpcError("fault-tolerant training: " + worker_text(r) + " cannot run step " +
                                            std::to_string(step) + ": " + missing)),
           out);
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
    answer(
        round_.at(r),
        QuorumAnswer{epoch_, h.step, members_, recovers ? h.donor.at(position) : -1, serve, failure_epoch_, failure_},
        out);
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
  Ask a{committed, has_state, failed, Promise<QuorumAnswer>(), std::nullopt};
  auto answer = a.reply.get_future();
  enter_round(rank, std::move(a), now, out);
  close_round_if_ready(now, out);
  return answer;
}

void QuorumRounds::enter_round(int rank, Ask a, Clock::time_point now, Outbox& out) {
  if (!round_deadline_ && (expected_.count(rank) != 0 || expected_.empty()))
    round_deadline_ = now + (started_ ? options_.join_timeout : options_.startup_timeout);
  if (auto old = round_.find(rank); old != round_.end()) {  // asked again (its first request's caller gave up)
    refuse(old->second, std::make_exception_ptr(UsageError("superseded by a newer quorum request")), out);
    round_.erase(old);
  }
  round_.emplace(rank, std::move(a));
}

// ---- votes ----

void QuorumRounds::abort_members(const std::vector<int>& ranks, const std::string& why, Outbox& out) {
  if (!grouped()) return;
  for (int r : ranks) out.aborts.push_back({r, epoch_, current_step_, why});
}

void QuorumRounds::decide(const StepKey& key, bool outcome, const std::string& cause, Clock::time_point now,
                          Outbox& out) {
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
  std::vector<std::pair<int, Promise<VoteAnswer>>> asking;
  if (it != votes_.end()) {
    for (auto& p : it->second.waiting) out.votes.emplace_back(std::move(p), answer);
    asking = std::move(it->second.asking);
    votes_.erase(it);
  }
  if (decided_.emplace(key, answer).second) ++(outcome ? stats_.commits : stats_.aborted_steps);
  if (outcome && key.second + 1 > global_step_) {
    global_step_ = key.second + 1;
    if (key.first == epoch_) holders_ = members_;
  }
  if (outcome) {
    ask_at_commit(std::move(asking), key.second + 1, now, out);
  } else {
    for (auto& [r, p] : asking)
      out.vote_answers.emplace_back(std::move(p), VoteAnswer{false, std::get<1>(answer), false, {}});
  }
}

void QuorumRounds::ask_at_commit(std::vector<std::pair<int, Promise<VoteAnswer>>> voters, std::int64_t committed,
                                 Clock::time_point now, Outbox& out) {
  if (voters.empty()) return;
  const bool had_deadline = round_deadline_.has_value();
  std::vector<int> ranks;
  for (auto& [rank, p] : voters) {
    enter_round(rank, Ask{committed, /*has_state=*/true, /*failed=*/false, Promise<QuorumAnswer>(), std::move(p)}, now,
                out);
    ranks.push_back(rank);
  }
  close_round_if_ready(now, out);
  // Not answered at once (a replica is incomplete, or the round waits for a member that has not voted this way):
  // withdrawn, so that no commit waits on a round; the trainer asks at its next step.
  bool withdrawn = false;
  for (int rank : ranks) {
    auto a = round_.find(rank);
    if (a == round_.end() || !a->second.with_vote) continue;
    out.vote_answers.emplace_back(std::move(*a->second.with_vote), VoteAnswer{true, "", false, {}});
    round_.erase(a);
    withdrawn = true;
  }
  // The deadline these requests started goes with them: the requests held in the round wait for the members' next
  // step, as they did before.
  if (round_.empty() || (withdrawn && !had_deadline)) round_deadline_.reset();
}

std::variant<CommitAnswer, QuorumRounds::Vote*> QuorumRounds::cast(int rank, std::int64_t at_epoch, std::int64_t step,
                                                                   const std::string& error, Clock::time_point now,
                                                                   Outbox& out) {
  const StepKey key{at_epoch, step};
  if (auto d = decided_.find(key); d != decided_.end()) return d->second;
  const bool member = std::find(members_.begin(), members_.end(), rank) != members_.end();
  if (at_epoch != epoch_ || !member)  // a step of a quorum that has moved on
    return CommitAnswer{false,
                        not_committed(step, at_epoch == broken_epoch_
                                                ? broken_cause_
                                                : worker_text(rank) + " voted after its quorum (epoch " +
                                                      std::to_string(at_epoch) + ") was replaced (epoch " +
                                                      std::to_string(epoch_) + "): it was late past the join timeout")};
  if (!error.empty() || at_epoch == broken_epoch_) {
    // A lost member first: a survivor's own failure is then most likely its consequence.
    decide(key, false, at_epoch == broken_epoch_ ? broken_cause_ : worker_text(rank) + " failed it: " + error, now,
           out);
    return decided_.at(key);
  }
  auto [it, fresh] = votes_.try_emplace(key);
  if (fresh) {
    it->second.deadline = now + options_.join_timeout;
    it->second.voters = members_;
  }
  it->second.yes.insert(rank);
  return &it->second;
}

void QuorumRounds::settle(const StepKey& key, Clock::time_point now, Outbox& out) {
  if (auto it = votes_.find(key); it != votes_.end() && it->second.yes.size() == members_.size())
    decide(key, true, "", now, out);
}

Future<CommitAnswer> QuorumRounds::vote(int rank, std::int64_t at_epoch, std::int64_t step, const std::string& error,
                                        Clock::time_point now, Outbox& out) {
  auto cast_vote = cast(rank, at_epoch, step, error, now, out);
  if (auto* known = std::get_if<CommitAnswer>(&cast_vote)) return make_ready_future(CommitAnswer(*known));
  Promise<CommitAnswer> p;
  auto outcome = p.get_future();
  std::get<Vote*>(cast_vote)->waiting.push_back(std::move(p));
  settle({at_epoch, step}, now, out);
  return outcome;
}

Future<VoteAnswer> QuorumRounds::vote_and_ask(int rank, std::int64_t at_epoch, std::int64_t step,
                                              const std::string& error, Clock::time_point now, Outbox& out) {
  Promise<VoteAnswer> p;
  auto outcome = p.get_future();
  auto cast_vote = cast(rank, at_epoch, step, error, now, out);
  if (auto* known = std::get_if<CommitAnswer>(&cast_vote)) {
    if (std::get<0>(*known)) {  // a repeated vote on a committed step
      std::vector<std::pair<int, Promise<VoteAnswer>>> voter;
      voter.emplace_back(rank, std::move(p));
      ask_at_commit(std::move(voter), step + 1, now, out);
    } else {
      out.vote_answers.emplace_back(std::move(p), VoteAnswer{false, std::get<1>(*known), false, {}});
    }
    return outcome;
  }
  std::get<Vote*>(cast_vote)->asking.emplace_back(rank, std::move(p));
  settle({at_epoch, step}, now, out);
  return outcome;
}

void QuorumRounds::lost(int rank, const std::string& why, Clock::time_point now, Outbox& out) {
  expected_.erase(rank);
  if (!round_.empty() && !round_deadline_) round_deadline_ = now + options_.join_timeout;
  if (auto a = round_.find(rank); a != round_.end()) {
    refuse(a->second, std::make_exception_ptr(ConnectionError(why)), out);
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
    for (const auto& key : open) decide(key, false, broken_cause_, now, out);
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
           now, out);
}

std::optional<QuorumRounds::Clock::time_point> QuorumRounds::next_deadline() const {
  std::optional<Clock::time_point> next = round_deadline_;
  for (const auto& [key, v] : votes_)
    if (!next || v.deadline < *next) next = v.deadline;
  return next;
}

void QuorumRounds::stop(const std::string& why, Outbox& out) {
  for (auto& [r, a] : round_)
    refuse(a, std::make_exception_ptr(ShutdownError("the quorum coordinator has stopped")), out);
  round_.clear();
  for (auto& [key, v] : votes_) {
    for (auto& p : v.waiting) out.votes.emplace_back(std::move(p), CommitAnswer{false, not_committed(key.second, why)});
    for (auto& [r, p] : v.asking)
      out.vote_answers.emplace_back(std::move(p), VoteAnswer{false, not_committed(key.second, why), false, {}});
  }
  votes_.clear();
}

QuorumStats QuorumRounds::stats() const {
  QuorumStats s = stats_;
  for (const auto& [r, a] : round_) s.waiting.push_back(r);
  s.members = members_;
  return s;
}

}  // namespace corpc::ddp::ft_detail
