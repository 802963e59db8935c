// The caller's side of one launch_processes call that starts its ranks: starts them (fork or spawn), restarts a
// failed rank in place within its budget, watches them to the end or the bounds, and throws LaunchError naming each
// failed rank and why. Private to the launcher.
#pragma once

#include <functional>

#include "corpc/rpc/launch.hpp"

namespace corpc::detail {

// `call` counts the program's launch_processes calls (from 1): a spawned rank runs the same one. `inside_spawned_rank`:
// this process is itself a rank that StartMethod::spawn started (it may fork ranks, not spawn them).
void launch_group(int world_size, int call, const std::function<void(int rank)>& fn, const LaunchOptions& options,
                  bool inside_spawned_rank);

}  // namespace corpc::detail
