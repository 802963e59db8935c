// launch_processes: which of its roles this process plays in a launch (the caller that starts ranks, a rank that
// StartMethod::spawn started, a launcher's rank), and the public queries. The parts: the spawn protocol
// (launch_protocol.*), a rank's process (rank_process.*), fork safety (fork_safety.*), the supervisor of one launch
// (launch_supervisor.*).
#include "corpc/rpc/launch.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <string_view>

#include "rpc/environment.hpp"
#include "rpc/launch_protocol.hpp"
#include "rpc/launch_supervisor.hpp"
#include "rpc/rank_process.hpp"

namespace corpc {

namespace {

std::atomic<int> g_launch_calls{0};
bool g_running_spawned_rank = false;  // this process became the rank a spawn started it for

std::string describe(const std::vector<RankFailure>& failures) {
  std::string s = "launch_processes: " + std::to_string(failures.size()) + " rank(s) failed";
  for (auto& f : failures) s += "\n  rank " + std::to_string(f.rank) + ": " + f.reason;
  return s;
}

// Under a launcher that set a rank and world size (not launch_processes itself): this process's rank. The variables
// are init_rpc's (RANK/WORLD_SIZE, Open MPI's, PMI's, Slurm's: rpc/environment.hpp); errors name the one read.
std::optional<int> launcher_rank(int world_size) {
  if (detail::launched_by_launch_processes()) return std::nullopt;
  const int r = detail::rank_from_environment(), n = detail::world_size_from_environment();
  if (r < 0 || n < 0) return std::nullopt;
  const std::string rank = detail::rank_variable() + "=" + std::to_string(r);
  const std::string size = detail::world_size_variable() + "=" + std::to_string(n);
  if (n != world_size)
    throw UsageError("launch_processes(" + std::to_string(world_size) + "): this process runs under a launcher that " +
                     "started " + size + " ranks; start it with " + std::to_string(world_size) +
                     " (or without a launcher)");
  if (r >= n) throw UsageError("launch_processes: " + rank + " is not below " + size);
  return r;
}

}  // namespace

LaunchError::LaunchError(std::vector<RankFailure> failures)
    : RpcError(describe(failures)), failures_(std::move(failures)) {}

std::optional<int> launched_rank() {
  if (!detail::spawn_target()) return std::nullopt;
  return detail::spawn_target()->rank;
}

bool launching_process() {
  if (detail::spawn_target() || detail::launched_by_launch_processes())
    return false;  // a rank launch_processes started
  return detail::rank_from_environment() < 0 || detail::world_size_from_environment() < 0;  // else a launcher's rank
}

int rank_restart_count() { return detail::rank_restart_from_environment(); }

bool rejoining() { return detail::rejoin_from_environment(); }

void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options) {
  const int call = ++g_launch_calls;
  const auto& target = detail::spawn_target();
  if (target && call <= target->call && !g_running_spawned_rank) {
    if (call < target->call) return detail::replay_outcome(call);  // it ran in the caller
    detail::apply_spawn_environment();
    for (const char* v :
         {detail::kSpawnRank, detail::kSpawnCall, detail::kReportFd, detail::kSpawnHistory, detail::kSpawnEnvironment})
      ::unsetenv(v);
    ::fcntl(target->report_fd, F_SETFD, FD_CLOEXEC);
    g_running_spawned_rank = true;
    detail::run_rank_and_exit(target->rank, target->report_fd, fn);
  }
  // Every outcome is recorded, a launcher's rank's too: a spawned rank replays them by their order.
  try {
    if (auto rank = launcher_rank(world_size)) {
      std::string error = detail::run_rank(*rank, fn);
      if (!error.empty()) throw RpcError("rank " + std::to_string(*rank) + ": " + error);
    } else {
      detail::launch_group(world_size, call, fn, options, g_running_spawned_rank);
    }
    detail::record_success();
  } catch (...) {
    detail::record_failure(std::current_exception());
    throw;
  }
}

}  // namespace corpc
