// Rank 0's side of graceful shutdown's termination detection (shutdown.cpp has the protocol): the reports of each
// round, and the round's answer once every live rank has reported. Knows nothing of connections: who is alive and
// what the job lost are handed in. Any thread; one mutex, never held while anything else is taken.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "corpc/core/future.hpp"

namespace corpc::detail {

class ShutdownRounds {
 public:
  // A round's answer: (requests between live ranks, balanced and idle, the ranks the job lost in words: "" if none).
  using Result = std::tuple<std::uint64_t, bool, std::string>;

  // Records `rank`'s counts for `round` (per peer: user requests sent to it, handled from it; `idle`: nothing in
  // flight there); the future completes with the round's answer. Throws ShutdownError once closed.
  Future<Result> report(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                        std::vector<std::uint64_t> handled_from, bool idle);
  // Answers every round that each rank with alive[k] has reported to: balanced if every pair of live ranks agrees
  // (what i sent to j is what j handled from i) and all were idle.
  void answer_full_rounds(const std::vector<bool>& alive, const std::string& lost);
  // Fails the rounds still waiting, and refuses later reports (rank 0 leaves without waiting for the others).
  void close();

 private:
  struct Round {
    std::map<int, std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>>> reports;  // rank -> counts
    bool all_idle = true;
    Promise<Result> done;
  };
  std::mutex mutex_;
  std::map<std::int64_t, Round> rounds_;
  bool closed_ = false;
};

}  // namespace corpc::detail
