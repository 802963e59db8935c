/// @file
/// How a runtime starts, and per-call options.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "corpc/transport/tls.hpp"
#include "corpc/wire/device_map.hpp"
#include "corpc/wire/limits.hpp"

namespace corpc {

/// The environment fills what a program leaves at its default, never what it set: CORPC_SECRET (secret),
/// CORPC_TLS_CERT/KEY/CA/VERIFY (tls), CORPC_SEAL_FRAMES=0 (seal_frames), CORPC_TRACE (trace_path),
/// CORPC_SAME_HOST_SOCKET=0, CORPC_SAME_HOST_CHANNEL=0 and CORPC_CUDA_IPC=0 (same_host_socket, same_host_channel,
/// cuda_ipc). init_rpc applies it; each field's comment
/// says which variable fills it.
/// How init_rpc starts this process's runtime: rendezvous, threads, timeouts, security, limits and flow control.
/// Every worker of a job should use compatible values (limits are announced to peers; timeouts are per worker).
struct RpcOptions {
  /// "env://" reads MASTER_ADDR, MASTER_PORT (and RANK/WORLD_SIZE when init_rpc is given -1), as torchrun, Slurm
  /// (SLURM_PROCID, SLURM_NTASKS) and Open MPI (OMPI_COMM_WORLD_RANK/SIZE) set them; "tcp://host:port" names rank 0's
  /// address directly.
  std::string init_method = "env://";
  /// Threads that run user functions. Coroutine functions hold no thread while suspended. 0: max(4, 2 x cores).
  /// The system sees them as "corpc-worker" (top -H, perf, gdb).
  int num_worker_threads = 0;
  /// I/O threads, each owning a share of the connections (and running the functions marked Execution::io_thread);
  /// named "corpc-io-0", "corpc-io-1", ...
  int num_io_threads = 1;
  /// How long a blocked wait()/rpc_sync spins before it sleeps (see corpc/core/executor.hpp); 0: never spin.
  std::chrono::microseconds spin_before_block{50};
  /// Runs first on each worker thread (once it is named): per-thread settings, e.g. at::set_num_threads (OpenMP's
  /// count is per thread).
  std::function<void()> worker_thread_init;
  /// Default timeout of every call (CallOptions::timeout overrides it); past it the call fails with TimeoutError.
  std::chrono::milliseconds rpc_timeout{60'000};
  /// How long init_rpc waits for all ranks to find each other before it throws TimeoutError (or CORPC_INIT_TIMEOUT_MS
  /// when left at its default: a launcher's job script can bound a job whose rank 0 never comes up).
  std::chrono::milliseconds init_timeout{60'000};
  /// This process replaces a rank that died in a running job (a launcher restarted it in place: corpcrun
  /// --max-rank-restarts, LaunchOptions::max_rank_restarts). Instead of the initial rendezvous it registers with rank 0
  /// as the rank's new incarnation, under the same name; rank 0 admits it once it has seen the predecessor's
  /// connection close (a claim for a rank that is still connected is refused, as always), and answers with the
  /// current table, and tells every other live rank the new incarnation's key and addresses. Until then a peer's calls
  /// to the rank fail as they did after the death, or wait for it (replacement_wait). Requests counted for the predecessor are
  /// forgotten (graceful shutdown balances the new incarnation's own). What lived in the predecessor (its RRefs,
  /// distributed autograd contexts, registered state) is not recovered: the program restores its own state (see
  /// corpc/ddp/fault_tolerant.hpp). Unset: true when the environment has CORPC_REJOIN=1.
  bool rejoin = false;
  /// How long a call to a rank that died may wait for a new incarnation to take the rank (a launcher that restarts
  /// ranks in place: corpcrun --max-rank-restarts, LaunchOptions::max_rank_restarts), within the call's own deadline.
  /// The call is then sent to the new incarnation as if just made; past the wait it fails with ConnectionError (the
  /// rank is gone), past its deadline with TimeoutError, and at shutdown with ShutdownError. A rank that shut down
  /// (its Goodbye) is not waited for, nor is anything when this is 0, the default: a call to a dead rank fails at
  /// once, which is what fault-tolerant training wants (it re-forms its quorum without the rank rather than wait).
  /// Calls in flight when the rank died fail as before: the new incarnation does not have them. Unset: the
  /// environment's CORPC_REPLACEMENT_WAIT_MS.
  std::chrono::milliseconds replacement_wait{0};
  /// How long a graceful shutdown waits for the other workers to finish; 0: as long as they are alive. Dead and
  /// silent peers (liveness_timeout) are detected and never waited for; the finite default bounds the rest (a peer
  /// that answers heartbeats but never finishes). A worker whose peers still train for longer must raise it.
  std::chrono::milliseconds shutdown_timeout{std::chrono::minutes(30)};
  /// Whether a graceful shutdown throws ConnectionError when the job lost a rank that no replacement took (it died,
  /// or left with shutdown_after_error): by default no rank of a failed job exits as a success. A job built to train
  /// on without its lost ranks (fault-tolerant DDP or pipeline replicas under a launcher that starts no replacement,
  /// such as srun or mpirun) sets it false: its shutdown then logs the lost ranks as a warning and returns. A lost
  /// rank 0 still fails it (it hosts the job's rendezvous and coordinator).
  bool lost_rank_fails_shutdown = true;
  /// Interface to listen on; empty: loopback when rank 0 is on loopback, otherwise all interfaces.
  std::string listen_address;
  /// Shared secret that every connection must prove knowledge of (HMAC challenge-response) before anything else is
  /// read from it; empty: the CORPC_SECRET environment variable (launch_processes sets a fresh one per run). With
  /// neither, the job is open to any process that can reach its ports, and init_rpc says so on stderr.
  std::string secret;
  /// TLS 1.3 on every connection, set up before the secret's challenge-response. Unset: from CORPC_TLS_CERT,
  /// CORPC_TLS_KEY and CORPC_TLS_CA (CORPC_TLS_VERIFY=0 for verify_peer = false) when CORPC_TLS_CERT is set;
  /// otherwise plain TCP.
  std::optional<TlsOptions> tls;
  /// How long a new connection may take to authenticate (TLS handshake included); a peer silent for longer is dropped.
  /// A dialer whose handshake stalls (or that the peer drops, for the same reason) tries twice more on a fresh
  /// connection before its calls fail with ConnectionError: a peer that is only busy (hundreds of ranks on a few
  /// cores) is not taken for a dead one.
  std::chrono::milliseconds handshake_timeout{5000};
  /// Whether every frame of a connection authenticated by the secret carries a tag (AES-256-GCM's GMAC under keys
  /// that the handshake derives for that connection alone), so that nothing on the path can change, replay, reorder
  /// or inject a frame: without it a process that relays a connection could rewrite every reply. Costs a few percent
  /// on small calls and more on large tensors over TCP (docs/benchmarks.md, "Frame integrity"); not needed, and not
  /// used, under TLS, whose records carry their own. Every rank must agree (a mismatch fails the handshake). Left
  /// true: CORPC_SEAL_FRAMES=0 turns it off.
  bool seal_frames = true;
  /// What this worker accepts from peers (announced to them; senders refuse larger messages with
  /// MessageTooLargeError before sending). Larger frames are a ProtocolError and close the connection.
  WireLimits limits;

  // ---- Flow control and liveness (docs/flow-control.md) ----
  /// Memory that requests from peers may hold here while they wait for a thread or run (their metadata, body and
  /// tensor data, reserved from each request's header before anything is allocated, given back once it is answered).
  /// While a connection's share or the process's total is spent, that connection is not read, so TCP slows its sender.
  /// A request larger than either budget fails on the caller's future with MessageTooLargeError.
  std::uint64_t receive_budget_per_connection = std::uint64_t{2} << 30;
  /// The process-wide total of that budget, over all connections (see receive_budget_per_connection).
  std::uint64_t receive_budget_per_process = std::uint64_t{4} << 30;
  /// Requests held at once (queued for the worker pool or running): the bound of the pool's queue. At it, reading
  /// requests pauses as for the memory budget.
  std::uint32_t max_requests_held = 65536;
  /// Unsent output on one connection (our replies to a peer that does not read them) beyond which that connection's
  /// requests are not read.
  std::uint64_t max_write_backlog_bytes = std::uint64_t{256} << 20;
  /// Calls to one peer sent and not yet answered. Beyond it a call waits for a reply to free room, holding no
  /// thread: rpc_async returns at once and the call leaves later, in order (its timeout runs meanwhile); only a
  /// caller on a thread of its own (main, a user thread; no corpc executor) blocks inside rpc_async until there is
  /// room, so that a loop issuing calls cannot pile up encoded messages without bound. Calls a handler makes while
  /// serving a request are not held back (nested calls that waited for room could wait on themselves), nor corpc's
  /// own bookkeeping (RRef messages); the callee's max_requests_held and receive budget bound those.
  std::uint32_t max_calls_in_flight_per_peer = 1024;
  /// A connection on which nothing arrives for this long, although heartbeats were sent (only while it is quiet), is
  /// closed and its peer treated as dead: its calls fail with ConnectionError, its RRefs and contexts are released,
  /// graceful shutdown stops waiting for it. Catches a stopped process or a partition without a reset, which TCP
  /// alone does not notice. Detected within 1.25x this. 0: never.
  std::chrono::milliseconds liveness_timeout{15'000};

  // ---- Same host (docs/transfers.md) ----
  /// Whether workers on one host (same boot id and network namespace) connect to each other over an abstract Unix
  /// socket instead of TCP on the loopback: the same stream and the same authentication, without the kernel's TCP
  /// path (a new connection costs ~0.6x, a small call's round trip ~0.8x: docs/benchmarks.md). Each worker listens on
  /// one as well as on its TCP port and publishes its name with its address; a dial falls back to TCP when the socket
  /// is not there. Off with TLS: every connection then carries TLS. Left true: CORPC_SAME_HOST_SOCKET=0 turns it off.
  bool same_host_socket = true;
  /// Whether connections between two workers on one host move large tensors (64 KiB of tensor data per message and
  /// more) through shared memory instead of the socket. Same host is decided during the handshake (boot id and
  /// network namespace, compared by both ends); the channel is set up when the first such message crosses the
  /// connection, either way (that message goes by TCP), or at once where CUDA IPC is agreed. A channel that cannot be
  /// set up leaves the connection on TCP, with one warning. Left true: CORPC_SAME_HOST_CHANNEL=0 turns it off.
  bool same_host_channel = true;
  /// Whether CUDA tensors bound for a worker on this host travel as CUDA IPC handles (a CUDA build of libtorch, a
  /// device, and the same-host channel on both ends) instead of through host memory. Left true: CORPC_CUDA_IPC=0
  /// turns it off.
  bool cuda_ipc = true;
  /// The shared ring of each direction of each such connection. A message whose tensors do not fit in the free part
  /// goes by TCP; received tensors are views of the ring while they hold less than half of it, copies beyond.
  /// Pages are touched only as the ring is used; a steady exchange reuses the same ones.
  std::uint64_t same_host_ring_bytes = std::uint64_t{256} << 20;

  // ---- Traces (corpc/core/trace.hpp) ----
  /// Where the job's Chrome trace goes (calls, executions, replies, large transfers, backward passes of every worker,
  /// merged by rank 0 at graceful shutdown); empty: the CORPC_TRACE environment variable; neither: no trace, and no
  /// cost beyond one branch per place that could record.
  std::string trace_path;

  // ---- CUDA tensors (docs/cuda.md; corpc/wire/device_map.hpp) ----
  /// device_maps[worker]: where this worker's CUDA tensors arrive on `worker` (and, inverted, where that worker's
  /// arrive here). Without an entry for a tensor's device, sending it to `worker` fails with UsageError. Checked at
  /// init_rpc against every worker's devices and maps; a bad one fails init_rpc on every worker with UsageError.
  std::map<std::string, DeviceMap> device_maps;
  /// The CUDA devices this worker uses for RPC (each map's sources must be among them, and maps to this worker must
  /// target them). Empty: those its own maps and its peers' maps to it name.
  std::vector<c10::Device> devices;
  /// Adds `map`'s entries to device_maps[worker], as PyTorch's TensorPipeRpcBackendOptions.set_device_map: throws
  /// UsageError for a device that is not CUDA with an index, two devices mapped to one, or an entry that contradicts
  /// one set before.
  void set_device_map(const std::string& worker, const DeviceMap& map);
  /// Sets `devices` (CUDA devices with an index, no repeats; UsageError otherwise).
  void set_devices(std::vector<c10::Device> devices);
};

/// Per-call options, passed first after the destination: `rpc_async<&f>("w1", corpc::with_timeout(100ms), x)`.
/// Also taken by remote(), RRef proxies and RemoteModule calls.
struct CallOptions {
  /// How long the caller waits: past it the call's future fails with TimeoutError, and the callee is sent a cancel
  /// (its function may still run until its next stop point). Unset: RpcOptions::rpc_timeout. Inside a call being
  /// handled, it is further cut to what is left of that call's deadline.
  std::optional<std::chrono::milliseconds> timeout;
  // ---- cancellation and deadlines (corpc/core/this_call.hpp) ----
  /// A stop request cancels the call, as Future::cancel does: the future completes with CancelledError and the
  /// callee's handler sees its own stop token stopped.
  std::stop_token stop_token;
};

/// CallOptions with a timeout: `corpc::with_timeout(std::chrono::milliseconds(100))`.
inline CallOptions with_timeout(std::chrono::milliseconds t) {
  CallOptions o;
  o.timeout = t;
  return o;
}
/// CallOptions whose stop token cancels the call: `corpc::with_stop_token(source.get_token())`.
inline CallOptions with_stop_token(std::stop_token token) {
  CallOptions o;
  o.stop_token = std::move(token);
  return o;
}

}  // namespace corpc
