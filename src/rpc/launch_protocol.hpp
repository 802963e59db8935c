// What launch_processes and the ranks it starts agree on: the variables a rank finds, the first byte of its report,
// and, for a rank that runs the program again (StartMethod::spawn), which call it runs, how the caller's earlier calls
// ended (so that it replays them) and the variables it takes on once it reaches its call. Private to the launcher.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace corpc::detail {

// What a rank started by StartMethod::spawn finds in its environment: which rank it runs, which launch_processes call
// of the program runs it (counted from 1), and the pipe on which it reports.
inline constexpr const char* kSpawnRank = "CORPC_LAUNCH_RANK";
inline constexpr const char* kSpawnCall = "CORPC_LAUNCH_CALL";
inline constexpr const char* kReportFd = "CORPC_LAUNCH_REPORT_FD";
// How each earlier launch_processes call of the caller ended, so that a spawned rank replays them.
inline constexpr const char* kSpawnHistory = "CORPC_LAUNCH_HISTORY";
// The rank's variables (RANK, MASTER_PORT, ...), set only once the rank reaches its call: code before it runs as in
// the caller, and a program that branches on RANK (as under a launcher) still reaches launch_processes.
inline constexpr const char* kSpawnEnvironment = "CORPC_LAUNCH_ENVIRONMENT";
// Set in every rank launch_processes starts: its RANK is ours, not a launcher's (so a launch inside it starts a group).
inline constexpr const char* kLaunched = "CORPC_LAUNCHED";
// Set in a rank that launch_processes or corpcrun started again after it failed: whether it rejoins a running job,
// and its restart's number. Never passed on from the caller: a launch inside a rank starts a new group.
inline constexpr const char* kRejoin = "CORPC_REJOIN";
inline constexpr const char* kRankRestart = "CORPC_RANK_RESTART";
// Which of this launch's processes a rank is, proven (src/transport/rank_identity.hpp): rank 0 gets the launch's key,
// every start of every rank the credential for its rank and restart. Never passed on from the caller.
inline constexpr const char* kRankKey = "CORPC_RANK_KEY";
inline constexpr const char* kRankCredential = "CORPC_RANK_CREDENTIAL";
// The first byte a rank writes on its report pipe: it reached its launch_processes call. Its error text follows.
inline constexpr char kStarted = 'S';

// In a process that StartMethod::spawn started: the rank it runs, at which call, reporting on which pipe. Read before
// main, since the variables are cleared once the rank runs.
struct SpawnTarget {
  int rank;
  int call;
  int report_fd;
};
const std::optional<SpawnTarget>& spawn_target();

// The outcomes of this process's finished launch_processes calls, in order (a spawned rank starts with its caller's):
// recorded by launch_processes, passed to each spawned rank (kSpawnHistory), replayed there.
void record_success();
void record_failure(std::exception_ptr error);  // a LaunchError, a UsageError or another error
std::string history_variable();
// In a spawned rank, an earlier launch_processes call of the caller's: ends it as it ended there (returns, or throws
// the same type with the same text).
void replay_outcome(int call);

// kSpawnEnvironment's value, and setting it in the rank (apply_spawn_environment reads it from this process's).
std::string encode_environment(const std::vector<std::pair<std::string, std::string>>& vars);
void apply_environment(std::string_view encoded);
void apply_spawn_environment();

}  // namespace corpc::detail
