// The quorum coordinator's decisions, without sockets, threads or clocks of its own: rounds of quorum requests that
// become epochs of whole replicas (or are refused, rather than restart history), and the commit vote on each step.
// QuorumCoordinator (quorum_coordinator.cpp) serialises the calls under its mutex, passes the time, and sends what a
// call put in its Outbox once the mutex is released; tests drive it directly (tests/test_quorum_rounds.cpp).
//
// A round: requests gather until every expected rank (the last epoch's members still alive; the replicas at first)
// has asked, or until the deadline the first of them set (QuorumOptions::join_timeout; startup_timeout before the
// first quorum). Then only replicas with every rank present become members, if there are at least min_replicas of
// them; the requests of an incomplete replica stay for a later round. The members that hold the newest committed
// state are donors, one per position in the replicas, to the members behind. A vote commits a step once every member
// voted yes; one member's failure, a member's loss, or a silent member past join_timeout vote it down. A vote may carry
// the voter's request for the next step's quorum (vote_and_ask): made at the commit, it closes the next round at once
// when every member asks that way, so that a step costs the trainers one request instead of two.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "corpc/core/future.hpp"
#include "corpc/ddp/quorum.hpp"

#include "ddp/fault_tolerant_calls.hpp"

namespace corpc::ddp::ft_detail {

using QuorumClock = std::chrono::steady_clock;

// What one call decided for others, completed by the caller once its lock is released (a requester in this process
// may resume inline), in this order: replies, refusals, then aborts sent to members.
struct Outbox {
  std::vector<std::pair<Promise<QuorumAnswer>, QuorumAnswer>> quorums;
  std::vector<std::pair<Promise<CommitAnswer>, CommitAnswer>> votes;
  std::vector<std::pair<Promise<QuorumAnswer>, std::exception_ptr>> refusals;
  std::vector<std::pair<Promise<VoteAnswer>, VoteAnswer>> vote_answers;  // vote_and_ask's
  // Replica groups: a member told at once that its attempt is taken by nobody (the request abort_attempt).
  struct Abort {
    int rank;
    std::int64_t epoch, step;
    std::string why;
  };
  std::vector<Abort> aborts;

  // Completes the replies and refusals (not the aborts, which need RPC).
  void complete_replies();
};

class QuorumRounds {
 public:
  using Clock = QuorumClock;

  // `options` as the coordinator completed them (`replicas` set). UsageError for replica groups of unequal sizes or
  // a rank in two of them.
  explicit QuorumRounds(QuorumOptions options);

  const QuorumOptions& options() const { return options_; }

  // A trainer's quorum request: answered when its round closes (perhaps by this call), refused with UsageError if it
  // asks again ("superseded by a newer quorum request"), RpcError if no member can be given the last committed state.
  Future<QuorumAnswer> ask(int rank, std::int64_t committed, bool has_state, bool failed, Clock::time_point now,
                           Outbox& out);
  // A member's vote on `step` of `epoch` with its own failure ("": none); answered once the vote is decided.
  Future<CommitAnswer> vote(int rank, std::int64_t epoch, std::int64_t step, const std::string& error,
                            Clock::time_point now, Outbox& out);
  // As vote(), and once the step is committed, `rank`'s request for the next step's quorum, made in the round at the
  // commit: its answer completes the vote's if that round closes then (has_next); else the request is withdrawn and
  // the trainer asks at its next step, as without this.
  Future<VoteAnswer> vote_and_ask(int rank, std::int64_t epoch, std::int64_t step, const std::string& error,
                                  Clock::time_point now, Outbox& out);
  // `rank` died: no round waits for it, its request is refused with ConnectionError(why), a vote of its epoch fails.
  void lost(int rank, const std::string& why, Clock::time_point now, Outbox& out);
  // Closes what is due by `now`: a round past its deadline, votes past theirs (their silent members named).
  void expire(Clock::time_point now, Outbox& out);
  // The earliest deadline pending, if any.
  std::optional<Clock::time_point> next_deadline() const;
  // The coordinator stops: waiting requests fail with ShutdownError, open votes are not committed (`why`: the cause
  // a vote's answer gives).
  void stop(const std::string& why, Outbox& out);

  QuorumStats stats() const;  // with the ranks that wait in the open round, and the current members

 private:
  struct Ask {
    std::int64_t committed;
    bool has_state;
    bool failed;
    Promise<QuorumAnswer> reply;
    std::optional<Promise<VoteAnswer>> with_vote;  // made at a commit (vote_and_ask): answered with the vote instead
  };
  using StepKey = std::pair<std::int64_t, std::int64_t>;  // (epoch, step)
  struct Vote {
    std::vector<int> voters;  // the members of the vote's epoch
    std::set<int> yes;
    std::vector<Promise<CommitAnswer>> waiting;
    std::vector<std::pair<int, Promise<VoteAnswer>>> asking;  // vote_and_ask's voters
    Clock::time_point deadline;
  };
  // What the members of a closing round hold: the step they run, donors and who must recover.
  struct Holdings {
    std::int64_t step = 0;
    bool any_state = false, any_failed = false;
    std::map<int, int> donor;  // position in the replicas -> the member that serves it
    std::vector<int> behind;   // members that recover before the step
  };

  std::pair<int, int> place_of(int rank) const;  // (replica group, position); a rank in none is a group alone
  size_t group_size(int group) const;
  bool grouped() const { return !groups_.empty(); }

  // Closes the open round if it may (see the file's comment).
  void close_round_if_ready(Clock::time_point now, Outbox& out);
  bool round_may_close(Clock::time_point now) const;
  std::vector<int> complete_replicas(int& count) const;  // the ranks of the round's whole replicas, ascending
  Holdings holdings_of(const std::vector<int>& members) const;
  // Why no member can be given the last committed state ("" if each can), and the step it is refused at.
  std::string missing_state(const Holdings& h, std::int64_t& refused_step) const;
  void refuse_round(const std::vector<int>& members, std::int64_t step, const std::string& missing, Outbox& out);
  void open_epoch(const std::vector<int>& members, const Holdings& h, Outbox& out);

  // A request's answer or refusal, to its caller or with the vote it came with (a refused one is withdrawn: asked
  // again at the trainer's next step, the refusal reaches it there).
  static void answer(Ask& a, QuorumAnswer q, Outbox& out);
  static void refuse(Ask& a, std::exception_ptr e, Outbox& out);
  // The vote's part shared by vote() and vote_and_ask(): its answer if known now; else the open vote, with `rank`'s
  // yes counted, to which the caller adds its promise before settle() decides it if every member is in.
  std::variant<CommitAnswer, Vote*> cast(int rank, std::int64_t epoch, std::int64_t step, const std::string& error,
                                         Clock::time_point now, Outbox& out);
  void settle(const StepKey& key, Clock::time_point now, Outbox& out);
  // `rank`'s request into the open round: it starts the round's deadline if it is expected, and replaces (refuses)
  // an earlier one of the same rank.
  void enter_round(int rank, Ask a, Clock::time_point now, Outbox& out);
  // The committed voters' requests for the quorum of the step after (`committed` steps), made now; those the round
  // does not answer at once are withdrawn, their votes answered without a quorum.
  void ask_at_commit(std::vector<std::pair<int, Promise<VoteAnswer>>> voters, std::int64_t committed,
                     Clock::time_point now, Outbox& out);

  void abort_members(const std::vector<int>& ranks, const std::string& why, Outbox& out);
  // `cause`: why a step is not committed, naming the worker(s) it concerns (worker_text).
  void decide(const StepKey& key, bool outcome, const std::string& cause, Clock::time_point now, Outbox& out);

  QuorumOptions options_;
  std::map<int, std::pair<int, int>> place_;  // rank -> (replica group, position in it)
  std::vector<std::vector<int>> groups_;

  bool started_ = false;           // the first quorum has been answered
  std::int64_t epoch_ = 0;         // the current one (0: none yet)
  std::vector<int> members_;       // of the current epoch
  std::set<int> expected_;         // who a round waits for: the current members still alive (the replicas at first)
  std::int64_t broken_epoch_ = 0;  // a member of this epoch died: none of its steps can be committed any more
  std::string broken_cause_;       // which one, and how
  // Why the last attempt that was not committed failed (QuorumAnswer): its epoch, its reason, and whether that is a
  // member's loss, which no later reason replaces.
  std::int64_t failure_epoch_ = -1;
  std::string failure_;
  bool failure_is_loss_ = false;
  std::int64_t current_step_ = 0;  // the step of the last quorum answered
  QuorumStats stats_;

  std::map<int, Ask> round_;  // the open round's requests, by rank
  // Set when the first expected rank asks (or the first rank at all, when none is expected): a rank that joins waits
  // for the members to come to their next step, and never forms a quorum of its own while they are mid-step.
  std::optional<Clock::time_point> round_deadline_;
  std::int64_t global_step_ = 0;  // steps committed so far
  std::vector<int> holders_;      // the members that committed the last of them

  std::map<StepKey, Vote> votes_;            // open
  std::map<StepKey, CommitAnswer> decided_;  // closed, for late voters (pruned to recent epochs)
};

}  // namespace corpc::ddp::ft_detail
