// Whether this process may fork a rank: a forked child inherits other threads' locks but not the threads, and hangs
// in them (libtorch's OpenMP pool, its autograd workers, an RPC runtime). Private to the launcher.
#pragma once

namespace corpc::detail {

// The threads this process started since it loaded that a fork would leave behind locked: not the ones shared
// libraries start as they load (OpenBLAS's pool re-creates itself in a forked child), nor corpc's logger.
int threads_fork_would_strand();

}  // namespace corpc::detail
