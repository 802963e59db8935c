// Graceful shutdown: a worker waits until the whole job is quiet, then closes. Every worker reports its counts to rank 0
// in rounds (control calls, which are not counted themselves); rank 0 answers a round once every live rank has
// reported to it (ShutdownRounds), and the job is quiet when two answers in a row say balanced and idle with the same
// counts. A peer that dies drops out of the sums, so it cannot keep the others waiting. Each answer also carries rank
// 0's account of the ranks the job lost, so that every rank learns the job failed.
// The part keeps rank 0's rounds and what a worker needs to take part in them: the activity counts, the dead ranks
// (peer_table.hpp), and the background scope, whose library work (RRef control messages, values being created) keeps
// a worker from being idle until it is done. It reaches the rest of the runtime through ShutdownHost.
// Threads: run() on the thread that called shutdown(); report() and check_rounds() on any (I/O threads, a death).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "corpc/core/future.hpp"
#include "corpc/core/scope.hpp"
#include "corpc/rpc/detail/outbound.hpp"

#include "rpc/activity.hpp"
#include "rpc/peer_table.hpp"
#include "rpc/shutdown_rounds.hpp"

namespace corpc::detail {

// What graceful shutdown uses of the runtime.
class ShutdownHost {
 public:
  virtual ~ShutdownHost() = default;
  // Worker `rank`'s name, for the account of the ranks the job lost.
  virtual std::string name_of(int rank) const = 0;
  // Starts one of the runtime's own calls (the round's call to rank 0).
  virtual void start_call(OutboundCall&& call) = 0;
};

class GracefulShutdown {
 public:
  // Why a peer that said goodbye is gone (as opposed to one that died): not a loss of the job.
  static constexpr const char* kShutDownReason = "it shut down";

  struct Settings {
    int rank = 0;
    int world_size = 0;
    std::string worker;                   // our name, for messages
    std::chrono::milliseconds timeout{};  // RpcOptions::shutdown_timeout (0: no limit)
    std::chrono::milliseconds rpc_timeout{};
  };
  GracefulShutdown(ShutdownHost& host, Settings settings, Activity& activity, PeerTable& peers, TaskScope& background);

  struct Outcome {
    bool quiet = false;  // every live rank agreed, with rank 0, that the job is quiet (not: rank 0 lost, timeout)
    std::string lost;    // the ranks the job lost (rank 0's account once quiet, else this rank's own): "" if none
  };
  // Takes part in the rounds until the job is quiet, rank 0 is lost or the timeout passes; then writes this worker's
  // part of the trace if one is being taken.
  Outcome run();
  // Writes this worker's part of the trace (corpc/core/trace.hpp); `meet`: then waits in one more round for every
  // live worker to have written its own, after which rank 0 merges the parts.
  void finish_trace(bool meet);
  // The ranks this worker saw die or leave after an error, in words ("" if none).
  std::string lost_ranks() const;
  // Joins the background scope with a stop requested (its tasks unwind at their next await); after this, library
  // work that would start in it is dropped.
  void join_background() noexcept;

  // Rank 0: `rank`'s counts for `round`; the future completes with the round's answer.
  Future<ShutdownRounds::Result> report(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                        std::vector<std::uint64_t> handled_from, bool idle);
  // Rank 0: answers the rounds that every live rank has reported to (after a death, one rank fewer).
  void check_rounds();
  // Rank 0: fails the rounds peers still wait on, while the I/O threads that answer them still run (a continuation
  // queued on a stopped thread would never run), and refuses later reports.
  void close_rounds() { rounds_.close(); }

 private:
  // The activity counters at zero and nothing in the background scope.
  bool locally_idle() const;
  // Waits until locally_idle() or `deadline`; true if idle.
  bool wait_locally_idle(std::chrono::steady_clock::time_point deadline);
  // Reports our counts for `round` to rank 0 and waits for its answer.
  ShutdownRounds::Result ask_round(std::int64_t round, bool idle, std::chrono::milliseconds timeout);

  ShutdownHost& host_;
  const Settings settings_;
  Activity& activity_;
  PeerTable& peers_;
  TaskScope& background_;
  ShutdownRounds rounds_;
};

}  // namespace corpc::detail
