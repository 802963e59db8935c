/// @file
/// Restart the whole group when a rank dies, in the spirit of torchelastic's max_restarts.
///
/// ```cpp
///   corpc::ddp::launch_with_restarts(2, [](int rank, int restart) {
///     ... if a checkpoint exists, load it; train; checkpoint every few steps ...
///   }, /*max_restarts=*/3);
/// ```
///
/// A failed attempt (any rank throws, exits non-zero or dies; DDP's collective timeout makes the survivors fail
/// promptly rather than hang) is reported on stderr and the whole group is launched again, up to max_restarts
/// times; each rank sees the attempt number as `restart` and, as under torchrun, in TORCHELASTIC_RESTART_COUNT.
/// Resuming is the program's job: load the last checkpoint (corpc/ddp/checkpoint.hpp). The last failure is rethrown.
#pragma once

#include <functional>

#include "corpc/rpc/launch.hpp"

namespace corpc::ddp {

/// Runs `fn(rank, restart)` on `world_size` local ranks as launch_processes does, and relaunches the whole group
/// after a failed attempt, up to `max_restarts` times (see corpc/ddp/elastic.hpp). Returns the number of restarts it
/// took; rethrows the last attempt's LaunchError when none is left.
int launch_with_restarts(int world_size, const std::function<void(int rank, int restart)>& fn, int max_restarts,
                         LaunchOptions options = {});

}  // namespace corpc::ddp
