// The quorum coordinator's rounds and votes (src/ddp/quorum_rounds.hpp) on their own, without processes, sockets or a
// runtime: the test plays the trainers by asking and voting, and the clock by passing the time. What is checked is
// what a trainer would be answered (its quorum, its donor, the members it serves, or its refusal; a vote's outcome
// and its words), and the aborts the coordinator would send to the members of a replica group.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "corpc/rpc/errors.hpp"

#include "../src/ddp/quorum_rounds.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_quorum_rounds {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::ddp;
using namespace corpc::ddp::ft_detail;
using namespace std::chrono_literals;

namespace {

// The coordinator without its rank: the rounds, a clock the test moves, and the aborts it would have sent.
struct Coordinator {
  QuorumRounds rounds;
  QuorumClock::time_point now = QuorumClock::now();
  std::vector<Outbox::Abort> aborts;

  explicit Coordinator(QuorumOptions options) : rounds(with_replicas(std::move(options))) {}

  Future<QuorumAnswer> ask(int rank, std::int64_t committed, bool has_state = true, bool failed = false) {
    Outbox out;
    auto answer = rounds.ask(rank, committed, has_state, failed, now, out);
    deliver(out);
    return answer;
  }
  Future<CommitAnswer> vote(int rank, std::int64_t epoch, std::int64_t step, const std::string& error = "") {
    Outbox out;
    auto outcome = rounds.vote(rank, epoch, step, error, now, out);
    deliver(out);
    return outcome;
  }
  Future<VoteAnswer> vote_and_ask(int rank, std::int64_t epoch, std::int64_t step, const std::string& error = "") {
    Outbox out;
    auto outcome = rounds.vote_and_ask(rank, epoch, step, error, now, out);
    deliver(out);
    return outcome;
  }
  void lost(int rank, const std::string& why) {
    Outbox out;
    rounds.lost(rank, why, now, out);
    deliver(out);
  }
  void pass(std::chrono::milliseconds d) {
    now += d;
    Outbox out;
    rounds.expire(now, out);
    deliver(out);
  }

 private:
  void deliver(Outbox& out) {
    out.complete_replies();
    aborts.insert(aborts.end(), out.aborts.begin(), out.aborts.end());
  }
  // As QuorumCoordinator completes them: the ranks of the replica groups are the replicas.
  static QuorumOptions with_replicas(QuorumOptions o) {
    if (o.replicas.empty())
      for (const auto& g : o.replica_groups) o.replicas.insert(o.replicas.end(), g.begin(), g.end());
    return o;
  }
};

std::int64_t epoch_of(const QuorumAnswer& a) { return std::get<0>(a); }
std::int64_t step_of(const QuorumAnswer& a) { return std::get<1>(a); }
const std::vector<int>& members_of(const QuorumAnswer& a) { return std::get<2>(a); }
int donor_of(const QuorumAnswer& a) { return std::get<3>(a); }
const std::vector<int>& serves(const QuorumAnswer& a) { return std::get<4>(a); }
const std::string& failure_of(const QuorumAnswer& a) { return std::get<6>(a); }
bool committed(const VoteAnswer& v) { return std::get<0>(v); }
bool has_next(const VoteAnswer& v) { return std::get<2>(v); }
const QuorumAnswer& next_of(const VoteAnswer& v) { return std::get<3>(v); }

template <class T>
std::string error_text(const Future<T>& f) {
  try {
    (void)f.value();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

QuorumOptions two_replicas_of_two() {  // replica 0: ranks 1, 3; replica 1: ranks 2, 4 (positions 0 and 1)
  QuorumOptions o;
  o.replica_groups = {{1, 3}, {2, 4}};
  o.join_timeout = 3s;
  o.startup_timeout = 60s;
  return o;
}

QuorumOptions three_trainers() {
  QuorumOptions o;
  o.replicas = {1, 2, 3};
  o.join_timeout = 3s;
  return o;
}

}  // namespace

TEST_CASE("a replica with a rank missing is held back; its requests join the members' next round") {
  Coordinator c(two_replicas_of_two());
  auto a1 = c.ask(1, 0), a3 = c.ask(3, 0), a2 = c.ask(2, 0);
  CHECK_FALSE(a1.done());  // every replica is expected at first
  c.pass(60s);             // the startup timeout: replica 1 misses rank 4
  REQUIRE(a1.done());
  REQUIRE(a3.done());
  CHECK(members_of(a1.value()) == std::vector<int>{1, 3});
  CHECK(step_of(a1.value()) == 0);
  CHECK_FALSE(a2.done());
  CHECK(c.rounds.stats().waiting == std::vector<int>{2});

  auto a4 = c.ask(4, 0);
  c.pass(10s);  // nobody of the current epoch has asked: no deadline runs, the held requests wait for the members
  CHECK_FALSE(a2.done());
  CHECK_FALSE(a4.done());

  const auto e = epoch_of(a1.value());
  auto v1 = c.vote(1, e, 0), v3 = c.vote(3, e, 0);
  REQUIRE(v1.done());
  CHECK(std::get<0>(v1.value()));
  CHECK(c.rounds.stats().commits == 1);
  CHECK(c.aborts.empty());

  auto b1 = c.ask(1, 1), b3 = c.ask(3, 1);  // the members come to step 1: the whole replica 1 joins them
  REQUIRE(b1.done());
  REQUIRE(a2.done());
  REQUIRE(a4.done());
  CHECK(members_of(b1.value()) == std::vector<int>{1, 2, 3, 4});
  CHECK(step_of(a2.value()) == 1);
  CHECK(epoch_of(a2.value()) == e + 1);
}

TEST_CASE("a member behind recovers from the member at its own position in a replica that holds the step") {
  Coordinator c(two_replicas_of_two());
  // Replica 0 holds step 5; replica 1's rank 2 was restarted (no state), its rank 4 missed steps.
  auto a1 = c.ask(1, 5), a3 = c.ask(3, 5), a2 = c.ask(2, 0, /*has_state=*/false), a4 = c.ask(4, 2);
  REQUIRE(a1.done());
  REQUIRE(a4.done());
  for (const auto* a : {&a1, &a2, &a3, &a4}) CHECK(step_of(a->value()) == 5);
  CHECK(donor_of(a2.value()) == 1);  // position 0
  CHECK(donor_of(a4.value()) == 3);  // position 1
  CHECK(donor_of(a1.value()) == -1);
  CHECK(donor_of(a3.value()) == -1);
  CHECK(serves(a1.value()) == std::vector<int>{2});
  CHECK(serves(a3.value()) == std::vector<int>{4});
  CHECK(serves(a2.value()).empty());
  CHECK(c.rounds.stats().recoveries == 2);
}

TEST_CASE("a member behind with no donor at its position is refused rather than history restarted") {
  Coordinator c(two_replicas_of_two());
  // Position 1 of the replica at step 5 does not hold it (rank 3 is behind too): nobody can serve rank 4.
  auto a1 = c.ask(1, 5), a3 = c.ask(3, 4), a2 = c.ask(2, 5), a4 = c.ask(4, 4);
  REQUIRE(a4.done());
  CHECK(error_text(a4) ==
        "fault-tolerant training: worker of rank 4 cannot run step 5: no live member at position 1 of a replica "
        "holds the state of step 5 for worker of rank 3 to recover from");
  CHECK(a1.has_error());
  CHECK(c.rounds.stats().waiting.empty());
}

TEST_CASE("a member lost mid-step votes the step down, aborts its replica mates and is not waited for") {
  Coordinator c(two_replicas_of_two());
  auto a1 = c.ask(1, 0), a3 = c.ask(3, 0), a2 = c.ask(2, 0), a4 = c.ask(4, 0);
  REQUIRE(a1.done());
  const auto e = epoch_of(a1.value());
  auto v1 = c.vote(1, e, 0), v2 = c.vote(2, e, 0);
  CHECK_FALSE(v1.done());
  c.lost(4, "its connection closed");

  const std::string why = "step 0 was not committed: worker of rank 4 was lost: its connection closed";
  REQUIRE(v1.done());
  CHECK_FALSE(std::get<0>(v1.value()));
  CHECK(std::get<1>(v1.value()) == why);
  CHECK(std::get<1>(v2.value()) == why);
  // Every other member is told of the loss at once, and the vote's failure goes to the members that had not voted
  // yes (the lost one among them).
  std::vector<int> told;
  for (const auto& a : c.aborts) {
    CHECK(a.epoch == e);
    CHECK(a.step == 0);
    CHECK(a.why == why);
    told.push_back(a.rank);
  }
  std::sort(told.begin(), told.end());
  CHECK(told == std::vector<int>{1, 2, 3, 3, 4});
  // A survivor that votes later, with the collective's error, hears of the loss, not of itself.
  CHECK(std::get<1>(c.vote(3, e, 0, "gloo: connection reset").value()) == why);

  // The next round does not wait for rank 4: its replica is left out, and the failure comes with the quorum.
  auto b1 = c.ask(1, 0, true, true), b3 = c.ask(3, 0, true, true), b2 = c.ask(2, 0, true, true);
  REQUIRE(b1.done());
  CHECK(members_of(b1.value()) == std::vector<int>{1, 3});
  CHECK(epoch_of(b1.value()) == e + 1);
  CHECK(failure_of(b1.value()) == why);
  CHECK_FALSE(b2.done());
}

TEST_CASE("a lost rank's waiting request fails with its cause") {
  Coordinator c(three_trainers());
  auto a1 = c.ask(1, 0);
  c.lost(1, "killed");
  REQUIRE(a1.done());
  CHECK(error_text(a1) == "killed");
  CHECK(c.rounds.stats().waiting.empty());
}

TEST_CASE("a vote is down when a member failed it, or a member stays silent past the join timeout") {
  Coordinator c(three_trainers());
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0), a3 = c.ask(3, 0);
  REQUIRE(a3.done());
  const auto e = epoch_of(a1.value());

  auto v1 = c.vote(1, e, 0);
  auto v2 = c.vote(2, e, 0, "out of memory");
  REQUIRE(v1.done());
  CHECK(std::get<1>(v1.value()) == "step 0 was not committed: worker of rank 2 failed it: out of memory");
  CHECK(std::get<1>(c.vote(3, e, 0).value()) == std::get<1>(v1.value()));  // a late voter hears the same
  CHECK(c.aborts.empty());  // no replica groups: nobody waits for a mate's activation
  CHECK(c.rounds.stats().aborted_steps == 1);

  auto b1 = c.ask(1, 0, true, true), b2 = c.ask(2, 0, true, true), b3 = c.ask(3, 0, true, true);
  REQUIRE(b1.done());
  CHECK(epoch_of(b1.value()) == e + 1);  // a failed step starts a new epoch, with the same members
  auto w1 = c.vote(1, e + 1, 0), w2 = c.vote(2, e + 1, 0);
  c.pass(2s);
  CHECK_FALSE(w1.done());
  c.pass(1s);
  REQUIRE(w1.done());
  CHECK(std::get<1>(w1.value()) ==
        "step 0 was not committed: worker of rank 3 did not vote within the join timeout (3000 ms)");

  auto d1 = c.ask(1, 0, true, true), d2 = c.ask(2, 0, true, true), d3 = c.ask(3, 0, true, true);
  REQUIRE(d1.done());
  auto x1 = c.vote(1, epoch_of(d1.value()), 0), x2 = c.vote(2, epoch_of(d1.value()), 0);
  auto x3 = c.vote(3, epoch_of(d1.value()), 0);
  REQUIRE(x1.done());
  CHECK(std::get<0>(x1.value()));
  CHECK(std::get<0>(x3.value()));
  CHECK(c.rounds.stats().commits == 1);
  CHECK(c.rounds.stats().aborted_steps == 2);
}

TEST_CASE("too few whole replicas: the round waits for the next expected request") {
  auto o = three_trainers();
  o.min_replicas = 3;
  Coordinator c(o);
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0);
  c.pass(60s);
  CHECK_FALSE(a1.done());
  auto a3 = c.ask(3, 0);
  REQUIRE(a1.done());
  CHECK(members_of(a3.value()) == std::vector<int>{1, 2, 3});
}

TEST_CASE("the coordinator's stop fails the waiting requests and open votes") {
  Coordinator c(three_trainers());
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0), a3 = c.ask(3, 0);
  auto v1 = c.vote(1, epoch_of(a1.value()), 0);
  auto b = c.ask(2, 1);
  Outbox out;
  c.rounds.stop("the quorum coordinator on worker of rank 0 has stopped", out);
  out.complete_replies();
  CHECK(std::get<1>(v1.value()) == "step 0 was not committed: the quorum coordinator on worker of rank 0 has stopped");
  CHECK(error_text(b) == "the quorum coordinator has stopped");
}

TEST_CASE(
    "votes that carry the next request: the commit answers each with the next step's quorum, one request a step") {
  Coordinator c(three_trainers());
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0), a3 = c.ask(3, 0);
  REQUIRE(a1.done());
  const auto e = epoch_of(a1.value());
  for (std::int64_t step = 0; step < 3; ++step) {
    auto v1 = c.vote_and_ask(1, e, step), v2 = c.vote_and_ask(2, e, step);
    CHECK_FALSE(v1.done());
    auto v3 = c.vote_and_ask(3, e, step);
    for (const auto* v : {&v1, &v2, &v3}) {
      REQUIRE(v->done());
      const VoteAnswer answer = v->value();
      CHECK(committed(answer));
      REQUIRE(has_next(answer));
      CHECK(epoch_of(next_of(answer)) == e);  // nothing changed: the same epoch, its groups kept
      CHECK(step_of(next_of(answer)) == step + 1);
      CHECK(members_of(next_of(answer)) == std::vector<int>{1, 2, 3});
    }
  }
  CHECK(c.rounds.stats().commits == 3);
  CHECK(c.rounds.stats().quorums == 4);
  CHECK(c.rounds.stats().waiting.empty());
  CHECK(c.rounds.stats().members == std::vector<int>{1, 2, 3});
}

TEST_CASE("a replica waiting to join is taken in at the members' commit, its donors told with their vote") {
  Coordinator c(two_replicas_of_two());
  auto a1 = c.ask(1, 0), a3 = c.ask(3, 0);
  c.pass(60s);  // replica 1 is not there at the start
  REQUIRE(a1.done());
  const auto e = epoch_of(a1.value());
  auto a2 = c.ask(2, 0, /*has_state=*/false), a4 = c.ask(4, 0, /*has_state=*/false);
  CHECK(c.rounds.stats().waiting == std::vector<int>{2, 4});
  auto v1 = c.vote_and_ask(1, e, 0), v3 = c.vote_and_ask(3, e, 0);
  REQUIRE(v1.done());
  REQUIRE(a2.done());
  const VoteAnswer answer1 = v1.value(), answer3 = v3.value();
  REQUIRE(has_next(answer1));
  const QuorumAnswer& next1 = next_of(answer1);
  CHECK(epoch_of(next1) == e + 1);
  CHECK(step_of(next1) == 1);
  CHECK(members_of(next1) == std::vector<int>{1, 2, 3, 4});
  CHECK(serves(next1) == std::vector<int>{2});
  CHECK(serves(next_of(answer3)) == std::vector<int>{4});
  CHECK(donor_of(a2.value()) == 1);
  CHECK(donor_of(a4.value()) == 3);
  CHECK(c.rounds.stats().members == std::vector<int>{1, 2, 3, 4});
}

TEST_CASE("a commit whose next round cannot close at once answers without a quorum and leaves no request behind") {
  auto o = three_trainers();
  o.min_replicas = 3;
  Coordinator c(o);
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0), a3 = c.ask(3, 0);
  REQUIRE(a1.done());
  const auto e = epoch_of(a1.value());
  // Rank 3 votes without asking: the others' requests alone make no round of three.
  auto v1 = c.vote_and_ask(1, e, 0), v2 = c.vote_and_ask(2, e, 0);
  auto v3 = c.vote(3, e, 0);
  REQUIRE(v1.done());
  CHECK(committed(v1.value()));
  CHECK(std::get<0>(v3.value()));
  CHECK_FALSE(has_next(v1.value()));
  CHECK_FALSE(has_next(v2.value()));
  CHECK(c.rounds.stats().waiting.empty());
  CHECK_FALSE(c.rounds.next_deadline());
  // They ask at their next step, as without the vote's request.
  auto b1 = c.ask(1, 1), b2 = c.ask(2, 1), b3 = c.ask(3, 1);
  REQUIRE(b1.done());
  CHECK(step_of(b1.value()) == 1);
  CHECK(epoch_of(b1.value()) == e);
}

TEST_CASE("withdrawn requests take their deadline with them: a held replica's request waits for the next step") {
  Coordinator c(two_replicas_of_two());
  auto a1 = c.ask(1, 0), a3 = c.ask(3, 0);
  c.pass(60s);
  REQUIRE(a1.done());
  const auto e = epoch_of(a1.value());
  auto a2 = c.ask(2, 0, /*has_state=*/false);  // held: rank 4 is not there
  // Rank 3 votes without asking, so rank 1's request cannot close the round at the commit.
  auto v1 = c.vote_and_ask(1, e, 0);
  auto v3 = c.vote(3, e, 0);
  REQUIRE(v1.done());
  CHECK_FALSE(has_next(v1.value()));
  CHECK(c.rounds.stats().waiting == std::vector<int>{2});
  CHECK_FALSE(c.rounds.next_deadline());
  c.pass(10s);  // the held request waits for the members' next step
  CHECK_FALSE(a2.done());
}

TEST_CASE("a vote that carries the next request and fails, or is decided after a loss, answers without a quorum") {
  Coordinator c(three_trainers());
  auto a1 = c.ask(1, 0), a2 = c.ask(2, 0), a3 = c.ask(3, 0);
  const auto e = epoch_of(a1.value());
  auto v1 = c.vote_and_ask(1, e, 0);
  auto v2 = c.vote_and_ask(2, e, 0, "out of memory");
  REQUIRE(v1.done());
  CHECK_FALSE(committed(v1.value()));
  CHECK_FALSE(has_next(v1.value()));
  CHECK(std::get<1>(v1.value()) == "step 0 was not committed: worker of rank 2 failed it: out of memory");
  CHECK_FALSE(committed(v2.value()));

  auto b1 = c.ask(1, 0, true, true), b2 = c.ask(2, 0, true, true), b3 = c.ask(3, 0, true, true);
  REQUIRE(b1.done());
  const auto e2 = epoch_of(b1.value());
  auto w1 = c.vote_and_ask(1, e2, 0);
  c.lost(3, "connection reset");
  REQUIRE(w1.done());
  CHECK_FALSE(committed(w1.value()));
  CHECK_FALSE(has_next(w1.value()));
  CHECK(std::get<1>(w1.value()).find("worker of rank 3 was lost: connection reset") != std::string::npos);
}

TEST_CASE("replica groups of unequal sizes, or a rank in two, are refused") {
  QuorumOptions o;
  o.replica_groups = {{1, 2}, {3}};
  CHECK_THROWS_WITH_AS(QuorumRounds{o},
                       "QuorumOptions::replica_groups: every replica needs the same number of ranks (at least one)",
                       UsageError);
  o.replica_groups = {{1, 2}, {2, 3}};
  CHECK_THROWS_WITH_AS(QuorumRounds{o}, "QuorumOptions::replica_groups: rank 2 is in two replicas", UsageError);
}

}  // namespace test_quorum_rounds
