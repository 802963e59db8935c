// corpc/rpc/runtime.hpp — the one runtime object of a process.
//
// `init_rpc` creates it and `shutdown` ends it; everything else in corpc reaches it through `Runtime::get()`.
// It owns: one network thread (Asio) that reads and writes every connection and never runs user code; a pool of
// `num_worker_threads` threads that runs user functions and continuations; the connections to every peer (dialed
// lazily, one per direction); the table of calls in flight with their timeouts.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <typeindex>
#include <vector>

#include "corpc/core/executor.hpp"
#include "corpc/rpc/options.hpp"
#include "corpc/rpc/registry.hpp"
#include "corpc/rpc/worker_info.hpp"
#include "corpc/wire/message.hpp"

namespace corpc {

// Counters for tests, benchmarks and graceful shutdown.
struct RuntimeStats {
  std::uint64_t requests_sent = 0;      // user requests issued by this worker
  std::uint64_t requests_handled = 0;   // user requests this worker finished handling
  std::uint64_t calls_in_flight = 0;    // our requests still waiting for a reply
  std::uint64_t handlers_running = 0;   // requests we are handling now
};

// Hooks through which distributed autograd sees tensors cross the wire (installed by corpc/autograd).
struct TensorHooks {
  // Before a request or reply leaves inside context `ctx`: may record a send function; returns its message id or -1.
  std::function<std::int64_t(std::int64_t ctx, int dst, const std::vector<at::Tensor>& tensors)> on_send;
  // After one arrives: may attach recv functions to `tensors` (in place).
  std::function<void(std::int64_t ctx, std::int64_t msg_id, int src, std::vector<at::Tensor>& tensors)> on_recv;
};

class Runtime {
 public:
  // The running runtime; throws ShutdownError if init_rpc has not run or shutdown has.
  static Runtime& get();
  static Runtime* try_get() noexcept;

  const WorkerInfo& self() const noexcept;
  int rank() const noexcept { return self().rank; }
  int world_size() const noexcept;
  const WorkerInfo& worker(const WorkerRef& ref) const;  // throws UnknownWorkerError
  std::vector<WorkerInfo> workers() const;
  bool is_alive(int rank) const;
  const RpcOptions& options() const noexcept;
  Executor& executor() noexcept;  // the worker pool
  RuntimeStats stats() const;

  // ---- used by the call templates and the upper layers -------------------------------------------------------------
  // A request body with its envelope; the caller appends the arguments.
  static Message begin_request(std::string_view function, std::uint64_t signature);
  using ReplyCallback = std::function<void(Message* reply, std::exception_ptr error)>;
  // Sends a request built by begin_request. `on_reply` runs exactly once, on the network thread, with the reply
  // positioned after its envelope in `reply->body` (use reply_reader), or with the error. Never throws for
  // remote-side problems: those reach `on_reply`.
  // `counted` false: corpc's own shutdown protocol, which graceful shutdown must not wait for.
  void call(int dst, Message request, const CallOptions& options, ReplyCallback on_reply, bool counted = true);
  static Reader reply_reader(Message& reply, int src);

  void add_peer_failure_listener(std::function<void(int rank, const std::string& why)> listener);
  void set_tensor_hooks(TensorHooks hooks);
  // Called by the RRef layer to hold graceful shutdown while it still has bookkeeping to exchange.
  void set_quiescence_probe(std::function<bool()> idle);

  // State of an upper layer (RRefs, distributed autograd) that lives exactly as long as this runtime: created on first
  // use with `Ext(Runtime&)`, destroyed after every connection has closed. Keeps those layers out of this one.
  template <class Ext>
  std::shared_ptr<Ext> extension() {
    return std::static_pointer_cast<Ext>(
        extension_slot(typeid(Ext), [this] { return std::static_pointer_cast<void>(std::make_shared<Ext>(*this)); }));
  }

  struct Impl;
  explicit Runtime(std::unique_ptr<Impl> impl);
  ~Runtime();
  Impl& impl() noexcept { return *impl_; }

 private:
  std::shared_ptr<void> extension_slot(std::type_index key, const std::function<std::shared_ptr<void>()>& make);
  std::unique_ptr<Impl> impl_;
};

// Starts this process's runtime and waits until all `world_size` workers have found each other (RpcOptions::init_timeout).
// rank / world_size -1: from the environment (RANK, WORLD_SIZE, or SLURM_PROCID / SLURM_NTASKS, or Open MPI's).
// Names: 1–128 characters of [A-Za-z0-9_-:.], unique.
void init_rpc(std::string name, int rank = -1, int world_size = -1, RpcOptions options = {});

// graceful: waits until every worker has called shutdown and no worker has work in flight, then closes every
// connection. Never waits for a dead peer; gives up on live ones after RpcOptions::shutdown_timeout (if set).
// non-graceful: fails everything in flight with ShutdownError and closes at once.
void shutdown(bool graceful = true);

// Runs `init` on every runtime this process starts, before it exchanges any message. For layers that must be active
// on every worker (distributed autograd's hooks), registered from a static initialiser.
void add_runtime_initializer(std::function<void(Runtime&)> init);

WorkerInfo get_worker_info();                        // this worker
WorkerInfo get_worker_info(const WorkerRef& worker);  // throws UnknownWorkerError
std::vector<WorkerInfo> get_worker_infos();

}  // namespace corpc
