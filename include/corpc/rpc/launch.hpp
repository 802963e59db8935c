/// @file
/// Run N ranks of this program as local processes (like torch.multiprocessing.spawn).
///
/// ```cpp
///   int main(int argc, char** argv) {
///     // Runs again in every rank (see below): keep what comes before launch_processes cheap.
///     corpc::launch_processes(3, [](int rank) {
///       corpc::init_rpc("worker" + std::to_string(rank));   // env:// is set up for each rank
///       ...
///       corpc::shutdown();
///     });
///   }
/// ```
///
/// **How ranks start.** By default (StartMethod::spawn, as Python's `spawn` start method) each rank is a new process
/// that runs this program again, with the same arguments, and with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
/// LOCAL_RANK and LOCAL_WORLD_SIZE set as torchrun sets them. In that process `main` runs up to the same
/// launch_processes call, which then runs only `fn(rank)` and ends the process. The rules that follow:
///   - every rank must reach the call the same way (the same arguments, no decision on randomness or time); a rank
///     that exits before reaching it is reported as failed;
///   - code before the call runs in every rank: keep it cheap, or do it only where `launching_process()` is true;
///   - a program that launches several times: in a rank, the calls before its own return at once, running nothing.
/// StartMethod::fork forks the calling process instead (no `main` again, `fn` may capture anything), but only from a
/// process that has not started threads: a forked child inherits other threads' locks but not the threads (libtorch's
/// OpenMP pool, its autograd workers, an RPC runtime) and hangs in them. It refuses with UsageError otherwise (threads
/// that shared libraries start as they load, such as OpenBLAS's pool, are not counted: they handle fork).
///
/// **Under a launcher** (torchrun, corpcrun: RANK/WORLD_SIZE; Open MPI's mpirun: OMPI_COMM_WORLD_RANK/SIZE; MPICH:
/// PMI_RANK/SIZE; Slurm's srun: SLURM_PROCID/SLURM_NTASKS, read in that order): when a rank and world size are already
/// set and this process was not started by launch_processes, it runs `fn(rank)` in this process only; the world size
/// must equal `world_size` (else UsageError naming the launcher's variable). So one program serves both `./prog` and
/// `corpcrun -n 3 ./prog`, `srun -n 3 ./prog` or `mpirun -n 3 ./prog`.
///
/// Rank 0 inherits an already-bound listening socket, so concurrent launches never collide on a port. If a rank
/// fails (throws, exits non-zero, dies on a signal, or the timeout passes) the others get a grace period to finish,
/// are then killed, and launch_processes throws LaunchError naming each failed rank and why. A rank whose `fn`
/// returns or throws with its RPC runtime still running is shut down for it (corpc/rpc/runtime.hpp: `shutdown`,
/// `shutdown_after_error`). Children die with the parent.
///
/// **Restarting a rank in place.** With `LaunchOptions::max_rank_restarts` above 0, a rank other than 0 that fails
/// (throws, exits non-zero, dies on a signal) is started again with the same rank, the same env:// variables and the
/// same start method, while the others keep running: no grace period, nothing killed. The new process also finds
/// `CORPC_REJOIN=1` and `CORPC_RANK_RESTART=n` (1 for that rank's first restart), set where RANK is (`rejoining()`,
/// `rank_restart_count()`): it must join the running job rather than rendezvous as at the start, and may resume from
/// where the job is. Rank 0 is never restarted, since it hosts the rendezvous and the job's coordinator; its failure,
/// a rank's failure once its restarts are spent, or any failure after the job has started failing, fails the job as
/// above. The timeout bounds the whole job, restarts included.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "corpc/rpc/errors.hpp"

namespace corpc {

/// How launch_processes starts a rank (see the top of this header).
enum class StartMethod {
  spawn,  ///< run this program again, up to the same launch_processes call (the default)
  fork,   ///< fork this process; refused once it runs more than one thread
};

/// How launch_processes starts its ranks and how long it lets them run.
struct LaunchOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< For all ranks together.
  std::chrono::milliseconds grace{std::chrono::seconds(10)};   ///< After a first failure, before killing the rest.
  StartMethod start = StartMethod::spawn;                      ///< How each rank's process starts.
  /// Times each rank other than 0 may be started again after it fails (see the top of this header); 0: never.
  int max_rank_restarts = 0;
};

/// One rank that did not finish cleanly, and why (its exception's message, exit code or signal).
struct RankFailure {
  int rank;            ///< The rank that failed.
  std::string reason;  ///< What happened, in words.
};

/// Thrown by launch_processes when any rank failed; what() lists every failed rank.
class LaunchError : public RpcError {
 public:
  /// The failed ranks, in the order their failures were seen.
  explicit LaunchError(std::vector<RankFailure> failures);
  /// Each failed rank and why.
  const std::vector<RankFailure>& failures() const noexcept { return failures_; }

 private:
  std::vector<RankFailure> failures_;
};

/// Runs `fn(rank)` for ranks 0 to world_size-1, each in its own process with the env:// variables set (see the top
/// of this header); returns when all ranks have finished and throws LaunchError if any failed. Under a launcher, runs
/// this process's rank only and lets its exception through.
void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options = {});

/// In a process that launch_processes started (StartMethod::spawn) to run a rank, that rank: code before the
/// launch_processes call may skip work only the caller needs. Empty in the caller and everywhere else.
std::optional<int> launched_rank();

/// Whether this process is the one that starts the ranks: false in every rank that launch_processes started (either
/// start method, before its call as after it) and in every process under a launcher (torchrun, corpcrun, Slurm, Open
/// MPI: a rank and world size set), where each process is a rank. What only the launching process should do (a run
/// directory, a summary) goes under it: with StartMethod::spawn the code before the launch_processes call runs again
/// in each rank.
bool launching_process();

/// How many times the launcher has restarted this rank in place (CORPC_RANK_RESTART; 0 in a rank's first process and
/// outside a launcher). Under StartMethod::spawn it is set from the rank's launch_processes call on, as RANK is.
int rank_restart_count();

/// Whether this process replaces a failed rank of a job that is still running (CORPC_REJOIN=1), so it must join
/// that job instead of taking part in its initial rendezvous. Set where rank_restart_count() is.
bool rejoining();

}  // namespace corpc
