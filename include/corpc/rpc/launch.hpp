// corpc/rpc/launch.hpp — run N ranks of this program as local processes (like torch.multiprocessing.spawn).
//
//   corpc::launch_processes(3, [](int rank) {
//     corpc::init_rpc("worker" + std::to_string(rank));   // env:// is set up for each child
//     ...
//     corpc::shutdown();
//   });
//
// Each rank is a fork of the calling process with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
// LOCAL_WORLD_SIZE set, as torchrun sets them; rank 0 inherits an already-bound listening socket, so concurrent
// launches never collide on a port. Call it before the process starts threads of its own (as with any fork).
// If a rank fails (throws, exits non-zero, dies on a signal, or the timeout passes) the others get a grace period to
// finish, are then killed, and launch_processes throws LaunchError naming each failed rank and why. Children die with the parent.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "corpc/core/errors.hpp"

namespace corpc {

struct LaunchOptions {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // for all ranks together
  std::chrono::milliseconds grace{std::chrono::seconds(10)};   // after a first failure, before killing the rest
};

struct RankFailure {
  int rank;
  std::string reason;
};

class LaunchError : public RpcError {
 public:
  explicit LaunchError(std::vector<RankFailure> failures);
  const std::vector<RankFailure>& failures() const noexcept { return failures_; }

 private:
  std::vector<RankFailure> failures_;
};

void launch_processes(int world_size, const std::function<void(int rank)>& fn, LaunchOptions options = {});

}  // namespace corpc
