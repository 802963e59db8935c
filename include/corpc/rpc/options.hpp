// corpc/rpc/options.hpp — how a runtime starts, and per-call options.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <stop_token>
#include <string>

#include "corpc/wire/frame.hpp"

namespace corpc {

struct RpcOptions {
  // "env://" reads MASTER_ADDR, MASTER_PORT (and RANK/WORLD_SIZE when init_rpc is given -1), as torchrun, Slurm
  // (SLURM_PROCID, SLURM_NTASKS) and Open MPI (OMPI_COMM_WORLD_RANK/SIZE) set them; "tcp://host:port" names rank 0's
  // address directly.
  std::string init_method = "env://";
  // Threads that run user functions. Coroutine functions hold no thread while suspended. 0: max(4, 2 x cores).
  int num_worker_threads = 0;
  // I/O threads, each owning a share of the connections (and running the functions marked Execution::io_thread).
  int num_io_threads = 1;
  // How long a blocked wait()/rpc_sync spins before it sleeps (see corpc/core/executor.hpp); 0: never spin.
  std::chrono::microseconds spin_before_block{50};
  // Runs first on each worker thread: per-thread settings, e.g. at::set_num_threads (OpenMP's count is per thread).
  std::function<void()> worker_thread_init;
  std::chrono::milliseconds rpc_timeout{60'000};       // default per-call timeout
  std::chrono::milliseconds init_timeout{60'000};      // how long ranks may take to find each other
  // How long a graceful shutdown waits for the other workers to finish; 0: as long as they are alive. Dead peers are
  // detected and never waited for, so the default cannot hang on a crash; a worker whose peers still train for an
  // hour waits that hour, as PyTorch's shutdown does.
  std::chrono::milliseconds shutdown_timeout{0};
  // Interface to listen on; empty: loopback when rank 0 is on loopback, otherwise all interfaces.
  std::string listen_address;
  // Shared secret that every connection must prove knowledge of (HMAC challenge-response) before anything else is
  // read from it; empty: the CORPC_SECRET environment variable (launch_processes sets a fresh one per run). With
  // neither, the job is open to any process that can reach its ports, and init_rpc says so on stderr.
  std::string secret;
  // How long a new connection may take to authenticate; a peer silent for longer is dropped.
  std::chrono::milliseconds handshake_timeout{5000};
  WireLimits limits;
};

struct CallOptions {
  std::optional<std::chrono::milliseconds> timeout;  // unset: RpcOptions::rpc_timeout
  // ---- cancellation and deadlines (corpc/core/this_call.hpp) ----
  // A stop request cancels the call, as Future::cancel does: the future completes with CancelledError and the
  // callee's handler sees its own stop token stopped. Inside a call being handled, the timeout is further cut to what
  // is left of that call's deadline.
  std::stop_token stop_token;
};

inline CallOptions with_timeout(std::chrono::milliseconds t) {
  CallOptions o;
  o.timeout = t;
  return o;
}
inline CallOptions with_stop_token(std::stop_token token) {
  CallOptions o;
  o.stop_token = std::move(token);
  return o;
}

}  // namespace corpc
