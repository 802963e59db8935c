/// @file
/// Run N ranks of this program as local processes (like torch.multiprocessing.spawn).
///
/// ```cpp
///   corpc::launch_processes(3, [](int rank) {
///     corpc::init_rpc("worker" + std::to_string(rank));   // env:// is set up for each child
///     ...
///     corpc::shutdown();
///   });
/// ```
///
/// Each rank is a fork of the calling process with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
/// LOCAL_WORLD_SIZE set, as torchrun sets them; rank 0 inherits an already-bound listening socket, so concurrent
/// launches never collide on a port. Call it before the process starts threads of its own (as with any fork). If a rank
/// fails (throws, exits non-zero, dies on a signal, or the timeout passes) the others get a grace period to finish, are
/// then killed, and launch_processes throws LaunchError naming each failed rank and why. Children die with the parent.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "corpc/core/errors.hpp"

namespace corpc {

/// How long launch_processes lets its ranks run.
struct LaunchOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  ///< For all ranks together.
  std::chrono::milliseconds grace{std::chrono::seconds(10)};   ///< After a first failure, before killing the rest.
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

/// Runs `fn(rank)` for ranks 0 to world_size-1, each in a forked process with the env:// variables set (see the top
/// of this header); returns when all ranks have finished and throws LaunchError if any failed.
void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options = {});

}  // namespace corpc
