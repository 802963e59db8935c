// What the runtime's parts use of it: one RuntimeHost serves the call engines (CallHost), the request side
// (RequestHost), so that requests and replies are framed for a peer by the same function (frame_for), the rendezvous
// (RendezvousHost), graceful shutdown (ShutdownHost) and the same-host listener (LocalListener::Host).
#include "corpc/rpc/detail/outbound.hpp"

#include "rpc/call_engine.hpp"
#include "rpc/request_server.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc::detail {

namespace {

// Cancelling the future of a call (see CancelHook): the call is looked up by its connection and request id, on the
// connection that carries our calls to its callee now (a connection since closed failed the call already).
void cancel_call(const CancelHook& h) noexcept {
  Runtime* runtime = Runtime::try_get();
  if (!runtime) return;
  auto conn = runtime_impl(*runtime).peers->outgoing_if(static_cast<int>(h.a), static_cast<Connection*>(h.p));
  if (conn) CallEngine::of(*conn).cancel(conn, h.b);
}

class RuntimeHost final : public CallHost,
                          public RequestHost,
                          public RendezvousHost,
                          public ShutdownHost,
                          public LocalListener::Host {
 public:
  explicit RuntimeHost(Runtime::Impl& rt) : rt_(rt) {}

  // Each port.
  std::string name_of(int rank) const override { return rt_.name_of(rank); }
  // A request or a reply: stamped with the current distributed-autograd context (a reply's: the caller's, set by the
  // request side), then framed with the device map to `rank` (an empty map before the world is known); CUDA tensors
  // may be lent over `conn`'s CUDA IPC link.
  OutFrame frame_for(Message&& m, int rank, Connection& conn) override {
    const auto& hooks = rt_.tensor_hooks;
    m.head.context_id = hooks.context_slot >= 0 ? current_call_context().get(hooks.context_slot) : -1;
    m.head.message_id = -1;
    if (m.head.context_id != -1 && !m.tensors.empty() && hooks.on_send)
      m.head.message_id = hooks.on_send(m.head.context_id, rank, m.tensors);
    if (rank < 0 || rank >= static_cast<int>(rt_.device_maps.size()) || rank >= static_cast<int>(rt_.workers.size()))
      return prepare(std::move(m));
    // Only frames with CUDA tensors mapped to the peer can be lent anything: the others skip the link's lock.
    const bool lendable = !rt_.device_maps[rank].empty() && !m.tensors.empty();
    return prepare(std::move(m), rt_.device_maps[rank], rt_.workers[rank].name,
                   lendable ? conn.cuda_ipc_for_lending() : nullptr);
  }
  void received_tensors(const FrameHeader& h, int src, std::vector<at::Tensor>& tensors) override {
    const auto& hooks = rt_.tensor_hooks;
    if (h.context_id != -1 && h.message_id != -1 && !tensors.empty() && hooks.on_recv)
      hooks.on_recv(h.context_id, h.message_id, src, tensors);
  }
  Activity& activity() override { return *rt_.activity; }

  // CallHost.
  void arm_cancel(CancelSlot& slot, Connection& conn, std::uint64_t id) override {
    CancelHook hook;
    hook.fn = &cancel_call;
    hook.p = &conn;
    hook.a = static_cast<std::uint64_t>(conn.peer_rank);
    hook.b = id;
    slot.arm_cancel(std::move(hook));
  }
  std::chrono::milliseconds default_timeout() const override { return rt_.options.rpc_timeout; }

  // RequestHost.
  const std::string& self_name() const override { return rt_.self.name; }  // fixed before any connection exists
  const HandlerEntry* function(std::uint64_t function) const override { return global_registry().find(function); }
  bool park_until_world(const std::shared_ptr<Connection>& conn, Message& msg) override {
    return rt_.rendezvous->world().park_if_unknown(conn, msg);
  }
  Executor& pool() override { return *rt_.pool; }
  int autograd_context_slot() const override { return rt_.tensor_hooks.context_slot; }
  std::uint64_t max_request_bytes() const override { return rt_.options.limits.max_request_bytes; }

  // RendezvousHost.
  WorkerInfo self() const override {
    std::lock_guard lock(rt_.self_host_mutex);
    return rt_.self;
  }
  LocalAddress local_address() const override { return rt_.local_listener.address(); }
  void take_world(std::vector<WorkerInfo> workers, std::vector<LocalAddress> local,
                  const std::vector<DeviceConfig>& configs) override {
    std::vector<std::string> names;
    for (const auto& w : workers) names.push_back(w.name);
    auto resolved = resolve_device_maps(rt_.self.rank, names, configs);  // throws: the table is refused
    for (const auto& w : workers) rt_.rank_by_name[w.name] = w.rank;
    rt_.device_maps = std::move(resolved.by_rank);
    rt_.rpc_devices = std::move(resolved.devices);
    rt_.workers = std::move(workers);
    rt_.local_addresses = std::move(local);
    // Only the host can differ (rank 0 fills in the address it saw); the rest of self is read unlocked everywhere.
    std::lock_guard lock(rt_.self_host_mutex);
    rt_.self.host = rt_.workers[rt_.self.rank].host;
  }
  void forget_peer(int rank) override { rt_.activity->forget_peer(rank); }
  void restart_held_calls(int rank) override { detail::restart_held_calls(rt_, rank); }
  void dispatch(const std::shared_ptr<Connection>& conn, Message&& msg) override {
    rt_.frames.dispatch(conn, std::move(msg));
  }

  // ShutdownHost.
  void start_call(OutboundCall&& call) override { detail::start_call(rt_, std::move(call)); }

  // LocalListener::Host: an accepted Unix socket is served as a TCP one is, without a port to report.
  asio::io_context& pick_io() override { return rt_.pick_io(); }
  void serve_local(asio::ip::tcp::socket socket) override {
    rt_.accepted++;
    rt_.serve_accepted(std::move(socket), "127.0.0.1", 0);
  }
  void local_accept_failed() override { rt_.accept_errors++; }

 private:
  Runtime::Impl& rt_;
};

}  // namespace

std::unique_ptr<CallHost> make_call_host(Runtime::Impl& rt) { return std::make_unique<RuntimeHost>(rt); }
std::unique_ptr<RequestHost> make_request_host(Runtime::Impl& rt) { return std::make_unique<RuntimeHost>(rt); }
std::unique_ptr<RendezvousHost> make_rendezvous_host(Runtime::Impl& rt) { return std::make_unique<RuntimeHost>(rt); }
std::unique_ptr<ShutdownHost> make_shutdown_host(Runtime::Impl& rt) { return std::make_unique<RuntimeHost>(rt); }
std::unique_ptr<LocalListener::Host> make_local_listener_host(Runtime::Impl& rt) {
  return std::make_unique<RuntimeHost>(rt);
}

}  // namespace corpc::detail
