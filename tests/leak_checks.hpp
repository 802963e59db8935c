// End-of-scenario checks for tests that use RRefs or distributed autograd: every worker holds no references and no
// contexts. Bookkeeping messages may still be in flight when a scenario ends, so each check polls (bounded).
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/detail/context.hpp"

namespace corpc::test {

// No owned values, user references or pending forks on any of `ranks` (e.g. the survivors of a killed worker).
inline void expect_no_references_on(const std::vector<int>& ranks) {
  using namespace std::chrono_literals;
  auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    bool clean = true;
    std::string report;
    for (int r : ranks) {
      auto s = rref_stats(r).wait(10s);
      clean = clean && s.owned_values == 0 && s.user_references == 0 && s.pending_forks == 0;
      report += " [" + std::to_string(r) + ": owned " + std::to_string(s.owned_values) + ", users " +
                std::to_string(s.user_references) + ", pending " + std::to_string(s.pending_forks) + "]";
    }
    if (clean) return;
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("references leaked:" + report);
    std::this_thread::sleep_for(10ms);
  }
}

// No live distributed autograd context on any of `ranks`.
inline void expect_no_contexts_on(const std::vector<int>& ranks) {
  using namespace std::chrono_literals;
  auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    std::uint64_t live = 0;
    for (int r : ranks) live += dist_autograd::live_contexts(r).wait(10s);
    if (live == 0) return;
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error(std::to_string(live) + " contexts leaked");
    std::this_thread::sleep_for(10ms);
  }
}

// The ranks 0 .. world-1.
inline std::vector<int> all_ranks(int world) {
  std::vector<int> ranks(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) ranks[static_cast<std::size_t>(r)] = r;
  return ranks;
}
// No references / contexts on any of the `world` workers.
inline void expect_no_references(int world) { expect_no_references_on(all_ranks(world)); }
inline void expect_no_contexts(int world) { expect_no_contexts_on(all_ranks(world)); }

}  // namespace corpc::test
