/// @file
/// The one runtime object of a process.
///
/// `init_rpc` creates it and `shutdown` ends it; everything else in corpc reaches it through `Runtime::get()`.
/// It owns: the I/O threads (Asio), each of which reads and writes its connections and runs the functions marked
/// `Execution::io_thread`; a pool of `num_worker_threads` threads that runs every other user function and the
/// continuations of threads that have no executor of their own; the connections to every peer (dialed lazily, one per
/// direction) with the calls in flight on each and their deadlines. docs/ARCHITECTURE.md says what runs where.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <typeindex>
#include <vector>

#include "corpc/core/executor.hpp"
#include "corpc/core/scope.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/options.hpp"
#include "corpc/rpc/worker_info.hpp"

namespace at {
class Tensor;
}

namespace corpc {

/// This worker's RPC counters: diagnostics for users (as PyTorch's `rpc.api._get_debug_info()`), tests and benchmarks.
struct RuntimeStats {
  std::uint64_t requests_sent = 0;     ///< user requests issued by this worker
  std::uint64_t requests_handled = 0;  ///< user requests this worker finished handling
  std::uint64_t calls_in_flight = 0;   ///< our requests still waiting for a reply
  std::uint64_t handlers_running = 0;  ///< requests we are handling now
  std::uint64_t pool_threads_started =
      0;  ///< worker-pool threads ever started (replacements for blocked ones included)
};

namespace detail {
// Hooks through which distributed autograd sees tensors cross the wire (installed by corpc/autograd, from a runtime
// initializer: they are read without a lock afterwards).
struct TensorHooks {
  /// The CallContext slot whose value travels in every message header as its context id (-1: none).
  int context_slot = -1;
  /// Before a request or reply with tensors leaves inside context `ctx`: may record a send function; returns its
  /// message id or -1.
  std::function<std::int64_t(std::int64_t ctx, int dst, const std::vector<at::Tensor>& tensors)> on_send;
  /// After one arrives: may attach recv functions to `tensors` (in place).
  std::function<void(std::int64_t ctx, std::int64_t msg_id, int src, std::vector<at::Tensor>& tensors)> on_recv;
};
}  // namespace detail

/// The one RPC runtime of a process, alive from init_rpc to shutdown (see corpc/rpc/runtime.hpp). Most programs
/// never touch it: the free functions (rpc_async, get_worker_info, ...) reach it. Upper layers use the second group
/// of members to attach to it. All members are thread-safe.
class Runtime {
 public:
  /// The running runtime; throws ShutdownError if init_rpc has not run or shutdown has.
  static Runtime& get();
  /// The running runtime, or nullptr (never throws).
  static Runtime* try_get() noexcept;

  /// This worker's rank (get_worker_info() says the rest).
  int rank() const noexcept;
  /// The number of workers in the job.
  int world_size() const noexcept;
  const WorkerInfo& worker(const WorkerRef& ref) const;  ///< the worker `ref` names; UnknownWorkerError if none
  /// Every worker, by rank.
  std::vector<WorkerInfo> workers() const;
  /// False once worker `rank` is known to be dead (its connection failed or went silent past liveness_timeout), or
  /// if there is no such rank.
  bool is_alive(int rank) const;
  /// The options this runtime was started with.
  const RpcOptions& options() const noexcept;
  Executor& executor() noexcept;  ///< the worker pool
  /// A snapshot of this worker's counters.
  RuntimeStats stats() const;

  // ---- for the upper layers ----------------------------------------------------------------------------------------
  /// Calls `listener(rank, why)` once for each worker found dead, after its pending calls have been failed, on the
  /// thread that found out (often an I/O thread: keep it short, never block). Listeners live as long as the runtime.
  void add_peer_failure_listener(std::function<void(int rank, const std::string& why)> listener);
  /// Call from a runtime initializer (add_runtime_initializer), before any message is exchanged.
  void set_tensor_hooks(detail::TensorHooks hooks);
  /// How spawn_background starts a task, and what it keeps of the code that starts it.
  enum class Background : std::uint8_t {
    /// On this thread until its first suspension, with a fresh CallContext (no deadline or autograd context of the
    /// caller's); it resumes on the worker pool. For bookkeeping the caller does not wait for (RRef control messages,
    /// context releases).
    detached,
    /// On the worker pool, with the caller's CallContext (the deadline and autograd context of the request being
    /// handled): work done on that request's behalf, which may compute for long (an RRef's value on its owner).
    on_behalf_of_caller,
  };
  /// Runs `task` in the runtime's own task scope, for library work that nobody awaits. Its tasks see the scope's stop
  /// token. Graceful shutdown counts them as work in flight (no worker exits while one of them may still talk to it),
  /// then joins the scope with a stop requested; a non-graceful shutdown, or one past shutdown_timeout, stops it first.
  /// Returns false, and the task is dropped unstarted, once shutdown has closed the scope.
  bool spawn_background(Task<void> task, Background how = Background::detached) noexcept;

  /// State of an upper layer (RRefs, distributed autograd) that lives exactly as long as this runtime: created on first
  /// use with `Ext(Runtime&)`, destroyed after every connection has closed. Keeps those layers out of this one.
  template <class Ext>
  std::shared_ptr<Ext> extension() {
    return std::static_pointer_cast<Ext>(
        extension_slot(typeid(Ext), [this] { return std::static_pointer_cast<void>(std::make_shared<Ext>(*this)); }));
  }

  /// @cond INTERNAL
  struct Impl;  // src/rpc/runtime_impl.hpp
  explicit Runtime(std::unique_ptr<Impl> impl);
  /// @endcond
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

 private:
  friend Impl& runtime_impl(Runtime&) noexcept;
  std::shared_ptr<void> extension_slot(std::type_index key, const std::function<std::shared_ptr<void>()>& make);
  std::unique_ptr<Impl> impl_;
};

/// Starts this process's runtime and waits until all `world_size` workers have found each other
/// (RpcOptions::init_timeout). rank / world_size -1: from the environment (RANK, WORLD_SIZE, or SLURM_PROCID /
/// SLURM_NTASKS, or Open MPI's). Names: 1–128 characters of [A-Za-z0-9_-:.], unique. Blocks the calling thread. Throws
/// UsageError for a bad name, rank, init_method or a second runtime in the process, TimeoutError if the workers do not
/// all arrive in time, and ConnectionError if it cannot listen or a peer fails authentication (RpcOptions::secret).
void init_rpc(std::string name, int rank = -1, int world_size = -1, RpcOptions options = {});

/// Stops this process's runtime. Every rank calls it (or shutdown_after_error) before it leaves; a process that exits
/// with its runtime running is shut down for it at exit, gracefully and with a warning, or as after an error if the
/// job had lost a rank.
/// graceful: waits until every worker has called shutdown and no worker has work in flight, then closes every
/// connection. Never waits for a dead peer; gives up on live ones after RpcOptions::shutdown_timeout (if set).
/// If the job lost a rank (it died, or left with shutdown_after_error), it closes everything and then throws
/// ConnectionError naming the lost ranks, so that no rank of a failed job exits as a success.
/// non-graceful: fails everything in flight with ShutdownError and closes at once; the peers see this rank as shut
/// down, not failed.
/// Does nothing if no runtime is running; afterwards init_rpc may start a new one. Call it from a plain thread (not
/// from an RPC handler).
void shutdown(bool graceful = true);

/// Stops this process's runtime at once because this rank failed with `what` (what a catch block calls): everything
/// in flight fails with ShutdownError, and every peer learns why this rank left: its calls to this rank fail with
/// ConnectionError carrying `what`, and its shutdown() throws. launch_processes calls it for a rank whose function
/// throws with the runtime still running. Does nothing if no runtime is running.
void shutdown_after_error(std::string_view what);

/// Runs `init` on every runtime this process starts, before it exchanges any message. For layers that must be active
/// on every worker (distributed autograd's hooks), registered from a static initialiser.
void add_runtime_initializer(std::function<void(Runtime&)> init);

WorkerInfo get_worker_info();                         ///< this worker
WorkerInfo get_worker_info(const WorkerRef& worker);  ///< the worker `worker` names; UnknownWorkerError if none
std::vector<WorkerInfo> get_worker_infos();           ///< every worker, by rank

}  // namespace corpc
