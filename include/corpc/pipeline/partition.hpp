/// @file
/// Cutting a row of costs into consecutive groups: the torch-free core of balance.hpp's balance-by-time, and the
/// first guess schedule_balance.hpp's search starts from.
#pragma once

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "corpc/rpc/errors.hpp"

namespace corpc::pipeline {

/// Consecutive groups of `costs` into `parts` parts (each at least one item), minimizing the largest group's sum.
/// Returns the size of each group. Exact (dynamic programming over cut points; layers number in the tens).
inline std::vector<int> partition_by_cost(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  if (parts < 1 || parts > n)
    throw UsageError("cannot cut " + std::to_string(n) + " layers into " + std::to_string(parts) + " stages");
  std::vector<double> prefix(n + 1, 0);
  for (int i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest possible maximum when the first i items form k groups; cut[k][i]: where the last begins.
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(parts + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k)
    for (int i = k; i <= n; ++i)
      for (int j = k - 1; j < i; ++j) {
        const double worst = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (worst < best[k][i]) best[k][i] = worst, cut[k][i] = j;
      }
  std::vector<int> sizes(parts);
  for (int k = parts, i = n; k >= 1; --k) {
    sizes[k - 1] = i - cut[k][i];
    i = cut[k][i];
  }
  return sizes;
}

}  // namespace corpc::pipeline
