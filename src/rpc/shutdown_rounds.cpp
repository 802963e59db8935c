// Rank 0's rounds of graceful shutdown (see shutdown_rounds.hpp).
#include "rpc/shutdown_rounds.hpp"

#include "corpc/rpc/errors.hpp"

namespace corpc::detail {

Future<ShutdownRounds::Result> ShutdownRounds::report(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                                      std::vector<std::uint64_t> handled_from, bool idle) {
  std::lock_guard lock(mutex_);
  if (closed_) throw ShutdownError("rank 0 is shutting down without waiting for the others");
  auto& r = rounds_[round];
  r.reports[rank] = {std::move(sent_to), std::move(handled_from)};
  r.all_idle = r.all_idle && idle;
  return r.done.get_future();
}

void ShutdownRounds::answer_full_rounds(const std::vector<bool>& alive, const std::string& lost) {
  const int world_size = static_cast<int>(alive.size());
  std::lock_guard lock(mutex_);
  for (auto& [round, r] : rounds_) {
    bool full = true;
    for (int k = 0; k < world_size && full; ++k) full = r.reports.count(k) || !alive[k];
    if (!full) continue;
    std::uint64_t total = 0;
    bool balanced = r.all_idle;
    for (auto& [i, ri] : r.reports) {
      for (auto& [j, rj] : r.reports) {
        if (!alive[i] || !alive[j] || ri.first.size() != alive.size() || rj.second.size() != alive.size()) continue;
        total += ri.first[j];
        balanced = balanced && ri.first[j] == rj.second[i];
      }
    }
    r.done.set_value(Result{total, balanced, lost});
  }
}

void ShutdownRounds::close() {
  std::map<std::int64_t, Round> pending;
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    pending.swap(rounds_);
  }
  // Outside the lock: each failure runs (or queues on an I/O thread) the continuation that answers the peer.
  for (auto& [round, r] : pending)
    r.done.set_exception(ShutdownError("rank 0 shut down without waiting for the others"));
}

}  // namespace corpc::detail
