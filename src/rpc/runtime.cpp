// The runtime's public surface, its threads, init_rpc, and the global pointer to the one runtime.
#include <regex>
#include <thread>

#include "corpc/core/detail/event.hpp"
#include "corpc/rpc/call.hpp"

#include "core/log.hpp"
#include "core/thread_name.hpp"
#include "core/trace_recorder.hpp"
#include "memory/cuda_transfer.hpp"
#include "rpc/environment.hpp"
#include "rpc/runtime_exit.hpp"
#include "rpc/runtime_impl.hpp"
#include "wire/device_map.hpp"

namespace corpc {

namespace {

std::mutex g_runtime_mutex;
std::unique_ptr<Runtime> g_runtime;
std::atomic<Runtime*> g_runtime_ptr{nullptr};

void close_runtime_at_exit();

}  // namespace

std::vector<std::function<void(Runtime&)>>& runtime_initializers() {
  static std::vector<std::function<void(Runtime&)>> inits;
  return inits;
}

void add_runtime_initializer(std::function<void(Runtime&)> init) { runtime_initializers().push_back(std::move(init)); }

void validate_worker_name(const std::string& name) {
  static const std::regex ok("[A-Za-z0-9_\\-:.]{1,128}");
  if (!std::regex_match(name, ok))
    throw UsageError("invalid worker name '" + name + "': use 1-128 characters of A-Z a-z 0-9 _ - : .");
}

Runtime::Impl& runtime_impl(Runtime& rt) noexcept { return *rt.impl_; }

// ---- Runtime: public surface -------------------------------------------------------------------------------------

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

Runtime& Runtime::get() {
  Runtime* rt = g_runtime_ptr.load(std::memory_order_acquire);
  if (!rt) throw ShutdownError("corpc runtime is not running (call init_rpc first, and not after shutdown)");
  return *rt;
}
Runtime* Runtime::try_get() noexcept { return g_runtime_ptr.load(std::memory_order_acquire); }

int Runtime::rank() const noexcept { return impl_->self.rank; }
int Runtime::world_size() const noexcept { return impl_->world_size; }
const RpcOptions& Runtime::options() const noexcept { return impl_->options; }
Executor& Runtime::executor() noexcept { return *impl_->pool; }
std::vector<WorkerInfo> Runtime::workers() const { return impl_->workers; }

const WorkerInfo& Runtime::worker(const WorkerRef& ref) const {
  if (!ref.name().empty()) {
    auto it = impl_->rank_by_name.find(ref.name());
    if (it == impl_->rank_by_name.end()) throw UnknownWorkerError("no worker named '" + ref.name() + "'");
    return impl_->workers[it->second];
  }
  if (ref.rank() < 0 || ref.rank() >= impl_->world_size)
    throw UnknownWorkerError("no worker with rank " + std::to_string(ref.rank()) + " (world size " +
                             std::to_string(impl_->world_size) + ")");
  return impl_->workers[ref.rank()];
}

bool Runtime::is_alive(int rank) const { return impl_->peers->is_alive(rank); }

RuntimeStats Runtime::stats() const {
  const auto& a = *impl_->activity;
  return {a.requests_sent(), a.requests_handled(), a.calls_in_flight(), a.handlers_running(),
          impl_->pool->threads_started()};
}

std::shared_ptr<void> Runtime::extension_slot(std::type_index key, const std::function<std::shared_ptr<void>()>& make) {
  std::lock_guard lock(impl_->extensions_mutex);
  auto& slot = impl_->extensions[key];
  if (!slot) slot = make();
  return slot;
}

void Runtime::add_peer_failure_listener(std::function<void(int, const std::string&)> listener) {
  std::lock_guard lock(impl_->hooks_mutex);
  impl_->failure_listeners.push_back(std::move(listener));
}
void Runtime::set_tensor_hooks(detail::TensorHooks hooks) { impl_->tensor_hooks = std::move(hooks); }
bool Runtime::spawn_background(Task<void> task, Background how) noexcept {
  try {
    if (how == Background::on_behalf_of_caller) {
      // The caller's context, with the scope's stop token; posted to the pool, never run on the caller's thread (an
      // I/O thread, while it dispatches a request).
      (void)impl_->background.spawn(*impl_->pool, std::move(task));
      return true;
    }
    // Outside whatever the caller was doing: no deadline, no distributed-autograd context, the scope's stop token.
    // Bookkeeping, not the program's own calls: exempt from max_calls_in_flight_per_peer, so that it never blocks the
    // thread it starts on (a handler's, below: no executor) waiting for room behind them.
    CallContext bookkeeping;
    bookkeeping.set(detail::call_bound_exempt_slot(), 1);
    CallContextScope fresh{bookkeeping};
    // Nor on the caller's executor: the task would resume there after its first await, and a short-lived one (the
    // loop of a sync_wait that has returned) would never run it again. Without one it resumes on the worker pool.
    ExecutorScope none(nullptr);
    (void)impl_->background.spawn(std::move(task));
    return true;
  } catch (...) {
    return false;  // the scope is closed: shutdown has joined it
  }
}

// ---- threads -------------------------------------------------------------------------------------------------------

namespace {
// What the rendezvous is told of this worker: who it is, what it accepts and announces.
detail::Rendezvous::Settings rendezvous_settings(const Runtime::Impl& rt) {
  detail::DeviceConfig devices;
  devices.device_count = detail::local_cuda_device_count();
  devices.devices = rt.options.devices;
  devices.maps = rt.options.device_maps;
  return {.rank = rt.self.rank,
          .world_size = rt.world_size,
          .worker = rt.self.name,
          .limits = rt.options.limits,
          .rejoin = rt.options.rejoin,
          .handshake_timeout = rt.options.handshake_timeout,
          .device_config = detail::encode_device_config(devices)};
}
}  // namespace

// Every frame kind gets its owner before any connection exists (frame_dispatcher.hpp).
void Runtime::Impl::route_frames() {
  call_host = detail::make_call_host(*this);
  request_host = detail::make_request_host(*this);
  local_host = detail::make_local_listener_host(*this);
  rendezvous_host = detail::make_rendezvous_host(*this);
  requests = std::make_unique<detail::RequestServer>(*request_host);
  rendezvous = std::make_unique<detail::Rendezvous>(*rendezvous_host, rendezvous_settings(*this), *peers, same_host,
                                                    detail::rank_proofs_from_environment());
  shutdown_host = detail::make_shutdown_host(*this);
  graceful =
      std::make_unique<detail::GracefulShutdown>(*shutdown_host,
                                                 detail::GracefulShutdown::Settings{.rank = self.rank,
                                                                                    .world_size = world_size,
                                                                                    .worker = self.name,
                                                                                    .timeout = options.shutdown_timeout,
                                                                                    .rpc_timeout = options.rpc_timeout},
                                                 *activity, *peers, background);
  detail::route_rendezvous(frames, *rendezvous);  // hello, world, refusal
  detail::route_requests(frames, *requests);      // request, cancel, oversized
  detail::route_replies(frames);                  // reply
  detail::route_ipc_done(frames);                 // ipc_done
  detail::route_goodbye(frames, *peers);          // goodbye
  detail::route_device_delivery(frames, *this);   // on_devices
}

void Runtime::Impl::start_threads() {
  int threads = options.num_worker_threads;
  if (threads <= 0) threads = std::max(4u, 2 * std::max(1u, std::thread::hardware_concurrency()));
  pool = std::make_unique<ThreadPool>(static_cast<std::size_t>(threads), [init = options.worker_thread_init] {
    detail::name_this_thread("corpc-worker");
    if (init) init();
  });
  io_threads = std::make_unique<detail::IoThreads>(options.num_io_threads);
  acceptor.emplace(main_io());
  io_threads->start();
  detail::set_spin_before_block(options.spin_before_block);
  set_default_executor(pool.get());
}

void Runtime::Impl::stop_threads() {
  set_default_executor(nullptr);
  io_threads->stop();
  pool->stop();
}

std::string Runtime::Impl::name_of(int rank) const {
  if (rendezvous->world().known() && rank >= 0 && rank < static_cast<int>(workers.size())) return workers[rank].name;
  return "rank " + std::to_string(rank);
}

// ---- init ----------------------------------------------------------------------------------------------------------

namespace {

// Where rank 0 listens: init_method's tcp://host:port, or env://'s MASTER_ADDR and MASTER_PORT (or what a launcher's
// variables give instead); throws UsageError naming what is missing or malformed.
Runtime::Impl::MasterAddress master_address(const RpcOptions& options) {
  std::string host;
  int port = -1;
  std::string host_source = "init_method";  // where host and port came from, for messages
  if (options.init_method.rfind("tcp://", 0) == 0) {
    auto hp = options.init_method.substr(6);
    auto colon = hp.rfind(':');
    if (colon == std::string::npos) throw UsageError("init_method must be tcp://host:port");
    host = hp.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);  // [::1]
    port = std::atoi(hp.c_str() + colon + 1);
  } else if (options.init_method == "env://") {
    host = detail::master_address_from_environment();
    port = detail::master_port_from_environment();
    host_source = detail::master_source_from_environment();
    if (host.empty() || port <= 0) {
      throw UsageError("init_method env:// needs MASTER_ADDR and MASTER_PORT (" + detail::rank_variable() + " is set" +
                       (detail::rank_variable() == "SLURM_PROCID"
                            ? ", but neither MASTER_ADDR nor SLURM_STEP_NODELIST/SLURM_JOB_NODELIST)"
                            : "; set both for every rank, e.g. mpirun -x MASTER_ADDR -x MASTER_PORT)"));
    }
  } else {
    throw UsageError("unknown init_method '" + options.init_method + "' (use env:// or tcp://host:port)");
  }
  if (port <= 0 || port > 65535) throw UsageError("invalid master port " + std::to_string(port));
  return {host, static_cast<std::uint16_t>(port), host_source};
}

// The handshake's settings from the options; says once in the log what protects this worker's port.
detail::AuthConfig auth_config(const RpcOptions& options, const std::string& worker) {
  detail::AuthConfig auth;
  auth.secret = options.secret;
  auth.timeout = options.handshake_timeout;
  auth.seal_frames = options.seal_frames;
  const auto& tls = options.tls;
  if (tls) {
    auth.tls = detail::make_tls_context(*tls);
    detail::log(detail::LogLevel::info, worker, "init_rpc", "TLS 1.3 on every connection ({} peer certificates)",
                tls->verify_peer ? "verifying" : "NOT verifying");
  }
  if (auth.secret.empty() && !(tls && tls->verify_peer)) {
    detail::log(detail::LogLevel::warn, worker, "init_rpc",
                "no shared secret (RpcOptions::secret or CORPC_SECRET): any process that can reach this worker's port "
                "can call its functions");
  }
  return auth;
}

}  // namespace

void init_rpc(std::string name, int rank, int world_size, RpcOptions options) {
  validate_worker_name(name);
  options = detail::with_environment(std::move(options));
  if (rank < 0) rank = detail::rank_from_environment();
  if (world_size < 0) world_size = detail::world_size_from_environment();
  if (rank < 0 || world_size <= 0 || rank >= world_size)
    throw UsageError("init_rpc: need 0 <= rank < world_size (got rank " + std::to_string(rank) + ", world size " +
                     std::to_string(world_size) + " from " + detail::rank_variable() + "/" +
                     detail::world_size_variable() + "); set RANK and WORLD_SIZE or pass them");
  // Device maps set field by field skip set_device_map's checks: made here, before anything starts. The checks
  // against the other workers follow at rendezvous.
  for (const auto& [worker, map] : options.device_maps) detail::check_invertible(map, worker);
  options.set_devices(std::move(options.devices));
  const auto master = master_address(options);

  std::lock_guard lock(g_runtime_mutex);
  if (g_runtime) throw UsageError("init_rpc called twice: this process already runs a corpc runtime");
  // After OpenSSL's own handler, so that ours runs first (exit handlers run in reverse order).
  static const bool at_exit_registered = [] {
    detail::initialize_openssl();
    return std::atexit(close_runtime_at_exit) == 0;
  }();
  (void)at_exit_registered;
  auto impl = std::make_unique<Runtime::Impl>();
  impl->options = options;
  impl->init_flow_control();
  impl->auth = auth_config(options, name);
  impl->self.name = std::move(name);
  impl->self.rank = rank;
  impl->world_size = world_size;
  impl->peers = std::make_unique<detail::PeerTable>(world_size);
  impl->activity = std::make_unique<detail::Activity>(world_size);
  impl->route_frames();
  auto* raw = impl.get();
  auto rt = std::make_unique<Runtime>(std::move(impl));
  trace::detail::start(options.trace_path, rank);
  raw->start_threads();
  // Before rendezvous: the hooks they install are read without a lock once connections exist.
  for (auto& init : runtime_initializers()) init(*rt);
  int listen_fd = -1;
  // The launcher's pre-bound socket matches MASTER_ADDR/MASTER_PORT, so it serves env:// only.
  if (rank == 0 && options.init_method == "env://") listen_fd = detail::listen_fd_from_environment();
  // Published before rendezvous ends: a peer that heard from rank 0 first may already be calling us, and its
  // requests run (after we have the table) with Runtime::get() working.
  g_runtime = std::move(rt);
  g_runtime_ptr.store(g_runtime.get(), std::memory_order_release);
  try {
    raw->start_rendezvous(master, listen_fd);
  } catch (...) {
    g_runtime_ptr.store(nullptr, std::memory_order_release);
    raw->close_everything(false);
    g_runtime.reset();
    trace::detail::stop();
    throw;
  }
}

namespace {

// Ends the running runtime; the caller holds g_runtime_mutex. Returns what the job lost, in words ("" if nothing).
std::string close_runtime(bool graceful, const std::string& failure) {
  auto& impl = runtime_impl(*g_runtime);
  detail::GracefulShutdown::Outcome outcome;
  if (graceful) outcome = impl.graceful->run();
  else if (trace::enabled()) impl.graceful->finish_trace(false);
  // A rank of a job that lost a rank (it died, or stopped after an error) must not exit as a success. Once the job
  // agreed that it is quiet, rank 0 may close first: a write that then meets its closed socket is not a death (seen
  // under load: "write failed: Broken pipe" recorded before rank 0's goodbye was read).
  std::string lost;
  if (graceful && !outcome.quiet && impl.self.rank != 0) {
    const auto farewell = impl.peers->farewell(0);
    const auto death = impl.peers->deaths()[0];
    if (!farewell.empty()) lost = "rank 0 stopped after an error (" + farewell + ")";
    else if (!death.empty() && death != detail::GracefulShutdown::kShutDownReason)
      lost = "rank 0 died before the job ended (" + death + ")";
  }
  if (graceful && lost.empty() && !outcome.lost.empty()) {
    if (impl.options.lost_rank_fails_shutdown) {
      lost = "the job lost " + outcome.lost;
    } else {
      detail::log(detail::LogLevel::warn, impl.self.name, "shutdown",
                  "the job lost {} (RpcOptions::lost_rank_fails_shutdown is off)", outcome.lost);
    }
  }
  impl.close_everything(true, failure);
  g_runtime_ptr.store(nullptr, std::memory_order_release);
  g_runtime.reset();
  trace::detail::stop();
  return lost;
}

// Whether this thread belongs to the runtime (a handler, an I/O thread): a graceful shutdown from it would wait for
// itself.
bool on_runtime_thread(Runtime::Impl& impl) { return impl.pool->running_here() || impl.io_threads->running_here(); }

// Registered by init_rpc: a process that exits with its runtime still running (main returned without shutdown())
// would destroy it under its running threads. Shut it down instead, and say so.
void close_runtime_at_exit() {
  try {
    (void)detail::close_runtime_left_open("");
  } catch (...) {}
}

}  // namespace

void shutdown(bool graceful) {
  std::lock_guard lock(g_runtime_mutex);
  if (!g_runtime) return;
  const std::string lost = close_runtime(graceful, "");
  if (!lost.empty()) throw ConnectionError("shutdown: " + lost + "; this worker stopped");
}

void shutdown_after_error(std::string_view what) {
  std::lock_guard lock(g_runtime_mutex);
  if (!g_runtime) return;
  (void)close_runtime(false, what.empty() ? std::string("unspecified error") : std::string(what));
}

namespace detail {

std::string close_runtime_left_open(const std::string& error) {
  std::lock_guard lock(g_runtime_mutex);
  if (!g_runtime) return {};
  auto& impl = runtime_impl(*g_runtime);
  const std::string name = impl.self.name;
  if (!error.empty()) {
    (void)close_runtime(false, error);
    return {};
  }
  const std::string lost = impl.graceful->lost_ranks();
  if (!lost.empty() || on_runtime_thread(impl)) {
    const std::string why = !lost.empty() ? "left without calling corpc::shutdown() after the job lost " + lost
                                          : "left without calling corpc::shutdown(), from one of the runtime's threads";
    log(LogLevel::error, name, "exit", "{}", why);
    (void)close_runtime(false, why);
    return why;
  }
  log(LogLevel::warn, name, "exit", "left without calling corpc::shutdown(): shutting down gracefully for it");
  const std::string job_lost = close_runtime(true, "");
  return job_lost.empty() ? std::string() : "shutdown: " + job_lost;
}

}  // namespace detail

WorkerInfo get_worker_info() { return runtime_impl(Runtime::get()).self; }
WorkerInfo get_worker_info(const WorkerRef& worker) { return Runtime::get().worker(worker); }
std::vector<WorkerInfo> get_worker_infos() { return Runtime::get().workers(); }

}  // namespace corpc
