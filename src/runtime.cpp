// The runtime: requests out and in, replies, timeouts, peer failure, graceful shutdown.
#include <cxxabi.h>

#include <ATen/ATen.h>

#include <cstring>
#include <regex>

#include "corpc/rpc/call.hpp"
#include "runtime_impl.hpp"

namespace corpc {

namespace {

std::mutex g_runtime_mutex;
std::unique_ptr<Runtime> g_runtime;
std::atomic<Runtime*> g_runtime_ptr{nullptr};

// Error frames: [u8 code][worker][function][type][message].
enum class ErrorCode : std::uint8_t { Remote = 1, UnknownFunction, ArgumentType, Protocol, Shutdown };

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

std::string current_exception_type() {
  auto* t = abi::__cxa_current_exception_type();
  return t ? demangle(t->name()) : "unknown";
}

std::exception_ptr decode_error(Message& msg, const std::string& fallback_worker, const std::string& function) {
  try {
    Reader r(msg.body.data(), msg.body.size());
    auto code = static_cast<ErrorCode>(r.get<std::uint8_t>());
    auto worker = r.get<std::string>();
    auto fn = r.get<std::string>();
    auto type = r.get<std::string>();
    auto message = r.get<std::string>();
    switch (code) {
      case ErrorCode::UnknownFunction: return std::make_exception_ptr(UnknownFunctionError(message));
      case ErrorCode::ArgumentType: return std::make_exception_ptr(ArgumentTypeError(message));
      case ErrorCode::Protocol: return std::make_exception_ptr(ProtocolError(message));
      case ErrorCode::Shutdown: return std::make_exception_ptr(ShutdownError(message));
      default: return std::make_exception_ptr(RemoteError(worker, fn, type, message));
    }
  } catch (const ProtocolError& e) {
    return std::make_exception_ptr(
        ProtocolError("malformed error reply from '" + fallback_worker + "' for '" + function + "': " + e.what()));
  }
}

// Graceful shutdown's termination detection, run on rank 0: each rank reports, per peer, the user requests it sent
// and the ones it finished handling; the world is quiet when every live pair balances and everyone is idle (see
// shutdown()). Counting per pair lets requests to a dead rank drop out instead of unbalancing the sums for ever.
using RoundResult = std::pair<std::uint64_t, bool>;
Future<RoundResult> shutdown_round(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                   std::vector<std::uint64_t> handled_from, bool idle) {
  auto& impl = Runtime::get().impl();
  Future<RoundResult> out;
  {
    std::lock_guard lock(impl.barrier_mutex);
    auto& r = impl.rounds[round];
    r.reports[rank] = {std::move(sent_to), std::move(handled_from)};
    r.all_idle = r.all_idle && idle;
    out = r.done.get_future();
  }
  impl.check_rounds();
  return out;
}

const bool g_control_registered = [] {
  // Not counted as work by graceful shutdown: its callers send it with kFlagControl (Runtime::call, counted = false).
  global_registry().add("corpc::shutdown_round", detail::make_entry<&shutdown_round>());
  return true;
}();

int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names) {
    if (const char* v = std::getenv(n); v && *v) return std::atoi(v);
  }
  return fallback;
}

}  // namespace

std::vector<std::function<void(Runtime&)>>& runtime_initializers() {
  static std::vector<std::function<void(Runtime&)>> inits;
  return inits;
}

void add_runtime_initializer(std::function<void(Runtime&)> init) { runtime_initializers().push_back(std::move(init)); }

Registry& global_registry() {
  static Registry registry;
  return registry;
}

void validate_worker_name(const std::string& name) {
  static const std::regex ok("[A-Za-z0-9_\\-:.]{1,128}");
  if (!std::regex_match(name, ok))
    throw UsageError("invalid worker name '" + name + "': use 1-128 characters of A-Z a-z 0-9 _ - : .");
}

// ---- Runtime: public surface -------------------------------------------------------------------------------------

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Runtime::~Runtime() = default;

Runtime& Runtime::get() {
  Runtime* rt = g_runtime_ptr.load(std::memory_order_acquire);
  if (!rt) throw ShutdownError("corpc runtime is not running (call init_rpc first, and not after shutdown)");
  return *rt;
}
Runtime* Runtime::try_get() noexcept { return g_runtime_ptr.load(std::memory_order_acquire); }

const WorkerInfo& Runtime::self() const noexcept { return impl_->self; }
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

bool Runtime::is_alive(int rank) const {
  std::lock_guard lock(impl_->conn_mutex);
  return rank >= 0 && rank < impl_->world_size && impl_->dead[rank].empty();
}

RuntimeStats Runtime::stats() const {
  return {impl_->requests_sent.load(), impl_->requests_handled.load(), impl_->calls_in_flight.load(),
          impl_->handlers_running.load()};
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
void Runtime::set_tensor_hooks(TensorHooks hooks) {
  std::lock_guard lock(impl_->hooks_mutex);
  impl_->tensor_hooks = std::move(hooks);
}
void Runtime::set_quiescence_probe(std::function<bool()> idle) {
  std::lock_guard lock(impl_->hooks_mutex);
  impl_->quiescence_probe = std::move(idle);
}

// Request envelope: [i64 autograd ctx][i64 autograd msg id][u64 signature][function name] then the arguments.
Message Runtime::begin_request(std::string_view function, std::uint64_t signature) {
  Message m;
  m.kind = FrameKind::Request;
  Writer w(m.body);
  w.put(current_call_context().autograd_context_id);
  w.put(std::int64_t{-1});
  w.put(signature);
  w.put(std::string(function));
  return m;
}

Reader Runtime::reply_reader(Message& reply, int src) {
  Reader r(reply.body.data() + kReplyEnvelopeBytes, reply.body.size() - kReplyEnvelopeBytes);
  r.tensors = &reply.tensors;
  r.peer = src;
  return r;
}

namespace {
// Reply callbacks run on the network thread (or wherever a failure is detected): one that throws must not take
// that thread down; the promise it fulfils has its own error path.
void invoke_callback(const Runtime::ReplyCallback& cb, Message* reply, std::exception_ptr error) noexcept {
  try {
    cb(reply, std::move(error));
  } catch (...) {
  }
}

std::int64_t read_i64(const std::string& body, std::size_t at) {
  std::int64_t v;
  std::memcpy(&v, body.data() + at, sizeof v);
  return v;
}
void write_i64(std::string& body, std::size_t at, std::int64_t v) { std::memcpy(body.data() + at, &v, sizeof v); }

// Lets distributed autograd record a send function; stamps its id into the envelope at offset 8.
void stamp_autograd(Runtime::Impl& impl, Message& m, int dst) {
  std::int64_t ctx = read_i64(m.body, 0);
  if (ctx == -1 || m.tensors.empty()) return;
  std::function<std::int64_t(std::int64_t, int, const std::vector<at::Tensor>&)> on_send;
  {
    std::lock_guard lock(impl.hooks_mutex);
    on_send = impl.tensor_hooks.on_send;
  }
  if (on_send) write_i64(m.body, 8, on_send(ctx, dst, m.tensors));
}

// The receiving half: lets distributed autograd attach recv functions to the tensors of a request or reply that
// carries a send-function id.
void attach_autograd(Runtime::Impl& impl, std::int64_t ctx, std::int64_t msg_id, int src, std::vector<at::Tensor>& tensors) {
  if (ctx == -1 || msg_id == -1 || tensors.empty()) return;
  std::function<void(std::int64_t, std::int64_t, int, std::vector<at::Tensor>&)> on_recv;
  {
    std::lock_guard lock(impl.hooks_mutex);
    on_recv = impl.tensor_hooks.on_recv;
  }
  if (on_recv) on_recv(ctx, msg_id, src, tensors);
}
}  // namespace

void Runtime::call(int dst, Message request, const CallOptions& options, ReplyCallback on_reply, bool counted) {
  auto& impl = *impl_;
  if (dst < 0 || dst >= impl.world_size) {
    return on_reply(nullptr, std::make_exception_ptr(UnknownWorkerError("no worker with rank " + std::to_string(dst))));
  }
  if (request.body.size() < 24) throw UsageError("request not built by begin_request");
  stamp_autograd(impl, request, dst);
  const std::uint64_t id = impl.next_request_id.fetch_add(1);
  request.id = id;
  request.kind = FrameKind::Request;
  request.flags = counted ? 0 : kFlagControl;
  std::string function;
  {
    Reader r(request.body.data() + 24, request.body.size() - 24);
    function = r.get<std::string>();
  }
  std::shared_ptr<detail::Connection> conn;
  try {
    conn = impl.connection_to(dst);
  } catch (...) {
    return on_reply(nullptr, std::current_exception());
  }
  const auto timeout = options.timeout.value_or(impl.options.rpc_timeout);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool rearm = false;
  {
    std::lock_guard lock(impl.pending_mutex);
    auto when = impl.deadlines.emplace(deadline, id);
    impl.pending.emplace(id, Impl::Pending{dst, std::move(function), std::move(on_reply), when, timeout, counted});
    if (deadline < impl.armed_for) {
      impl.armed_for = deadline;
      rearm = true;
    }
  }
  if (rearm) asio::post(impl.io, [&impl] { impl.arm_sweeper(); });
  if (counted) {
    impl.requests_sent++;
    impl.sent_to[dst]++;
    impl.calls_in_flight++;
  }
  // The peer may have died, or shutdown begun, since connection_to looked, and whoever failed the pending calls
  // then did not see this one: look again now that it is registered (each call still completes once).
  bool closing = false, dead = false;
  {
    std::lock_guard lock(impl.conn_mutex);
    closing = impl.closing;
    dead = !impl.dead[dst].empty();
  }
  if (closing) impl.fail_pending(dst, std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
  else if (dead) impl.fail_pending(dst, std::make_exception_ptr(ConnectionError("worker '" + impl.name_of(dst) + "' (rank " + std::to_string(dst) + ") is gone")));
  conn->send(std::move(request));
}

// ---- Runtime::Impl -----------------------------------------------------------------------------------------------

std::function<void(const std::shared_ptr<detail::Connection>&, Message&&)> Runtime::Impl::frame_handler() {
  return [this](const std::shared_ptr<detail::Connection>& c, Message&& m) { on_frame(c, std::move(m)); };
}
std::function<void(const std::shared_ptr<detail::Connection>&, const std::string&)> Runtime::Impl::close_handler() {
  return [this](const std::shared_ptr<detail::Connection>& c, const std::string& why) { on_close(c, why); };
}

void Runtime::Impl::start_threads() {
  int threads = options.num_worker_threads;
  if (threads <= 0) threads = std::max(4u, 2 * std::max(1u, std::thread::hardware_concurrency()));
  pool = std::make_unique<ThreadPool>(static_cast<std::size_t>(threads), options.worker_thread_init);
  io_thread = std::thread([this] { io.run(); });
}

std::string Runtime::Impl::name_of(int rank) const {
  if (world_known && rank >= 0 && rank < static_cast<int>(workers.size())) return workers[rank].name;
  return "rank " + std::to_string(rank);
}

std::shared_ptr<detail::Connection> Runtime::Impl::connection_to(int rank) {
  std::lock_guard lock(conn_mutex);
  if (closing) throw ShutdownError("corpc runtime is shutting down");
  if (!dead[rank].empty())
    throw ConnectionError("worker '" + workers[rank].name + "' (rank " + std::to_string(rank) + ") is gone: " + dead[rank]);
  auto& c = outgoing[rank];
  if (!c) {
    if (rank == self.rank) {
      c = detail::make_loopback_connection(io, frame_handler());
    } else {
      c = detail::dial_tcp_connection(io, rank, workers[rank].host, workers[rank].port, options.limits,
                                      frame_handler(), close_handler());
      c->send(hello_message(self, world_size, false));  // every dialed connection starts with who we are
    }
    c->peer_rank = rank;
    c->outgoing = true;
  }
  return c;
}

void Runtime::Impl::on_frame(const std::shared_ptr<detail::Connection>& conn, Message&& msg) {
  switch (msg.kind) {
    case FrameKind::Hello: return on_hello(conn, std::move(msg));
    case FrameKind::World: return on_world(std::move(msg));
    case FrameKind::Request: {
      if (conn->peer_rank < 0) return conn->close("request before hello");
      if (!world_known) return early_requests.emplace_back(conn, std::move(msg)), void();
      if (!(msg.flags & kFlagControl)) handlers_running++;
      pool->post([this, conn, m = std::make_shared<Message>(std::move(msg))]() mutable { handle_request(conn, std::move(*m)); });
      return;
    }
    case FrameKind::Response:
    case FrameKind::Error: {
      if (msg.id == 0) {  // the peer refused the connection itself
        std::string why = "refused by peer";
        try {
          std::rethrow_exception(decode_error(msg, name_of(conn->peer_rank), "rendezvous"));
        } catch (const std::exception& e) {
          why = e.what();
        }
        if (!world_ready.get_future().done()) world_ready.set_error(RpcError("rendezvous refused: " + why));
        return conn->close(why);
      }
      return deliver_reply(std::move(msg));
    }
    case FrameKind::Goodbye: return;
  }
}

void Runtime::Impl::deliver_reply(Message&& msg) {
  Pending p;
  {
    std::lock_guard lock(pending_mutex);
    if (!take_pending(msg.id, p)) return;  // timed out already, or failed with its peer
  }
  if (p.counted) calls_in_flight--;
  if (msg.kind == FrameKind::Error) return invoke_callback(p.callback, nullptr, decode_error(msg, name_of(p.dst), p.function));
  if (msg.body.size() < kReplyEnvelopeBytes) {
    return invoke_callback(p.callback, nullptr, std::make_exception_ptr(ProtocolError("reply without envelope")));
  }
  std::int64_t ctx = read_i64(msg.body, 0);
  std::int64_t msg_id = read_i64(msg.body, 8);
  attach_autograd(*this, ctx, msg_id, p.dst, msg.tensors);
  invoke_callback(p.callback, &msg, nullptr);
}

void Runtime::Impl::handle_request(std::shared_ptr<detail::Connection> conn, Message msg) {
  const bool counted = !(msg.flags & kFlagControl);
  const std::uint64_t id = msg.id;
  const int src = conn->peer_rank;
  std::string function;
  auto finish = [this, counted, src] {
    if (counted) {
      requests_handled++;
      if (src >= 0 && src < world_size) handled_from[src]++;
      handlers_running--;
    }
  };
  try {
    Reader r(msg.body.data(), msg.body.size());
    const auto ctx = r.get<std::int64_t>();
    const auto msg_id = r.get<std::int64_t>();
    const auto signature = r.get<std::uint64_t>();
    function = r.get<std::string>();
    auto entry = global_registry().find(function);
    if (!entry) {
      throw UnknownFunctionError("no function '" + function + "' is registered on worker '" + self.name +
                                 "' (different binaries? register it by name)");
    }
    if (entry->signature != 0 && signature != 0 && entry->signature != signature) {
      throw ArgumentTypeError("arguments do not match '" + function + "' on worker '" + self.name + "', which takes " +
                              entry->signature_text);
    }
    attach_autograd(*this, ctx, msg_id, src, msg.tensors);
    auto owned = std::make_shared<Message>(std::move(msg));
    Inbound in{src, function, r, owned.get()};
    in.args.tensors = &owned->tensors;
    in.args.peer = src;
    Future<Message> reply;
    {
      CallContextScope scope(CallContext{ctx});
      reply = entry->handler(in);
    }
    reply.on_complete_inline([this, conn, id, ctx, src, owned, reply, function, finish] {
      if (auto e = reply.error()) {
        send_error(conn, id, e, function);
      } else {
        Message out = reply.value();
        out.kind = FrameKind::Response;
        out.id = id;
        write_i64(out.body, 0, ctx);
        write_i64(out.body, 8, -1);
        if (ctx != -1) stamp_autograd(*this, out, src);
        conn->send(std::move(out));
      }
      finish();
    });
  } catch (...) {
    send_error(conn, id, std::current_exception(), function);
    finish();
  }
}

void Runtime::Impl::send_error(const std::shared_ptr<detail::Connection>& conn, std::uint64_t id,
                               std::exception_ptr error, std::string_view function) {
  ErrorCode code = ErrorCode::Remote;
  std::string type, message;
  try {
    std::rethrow_exception(error);
  } catch (const UnknownFunctionError& e) {
    code = ErrorCode::UnknownFunction, type = "corpc::UnknownFunctionError", message = e.what();
  } catch (const ArgumentTypeError& e) {
    code = ErrorCode::ArgumentType, type = "corpc::ArgumentTypeError", message = e.what();
  } catch (const ProtocolError& e) {
    code = ErrorCode::Protocol, type = "corpc::ProtocolError", message = e.what();
  } catch (const std::exception& e) {
    type = current_exception_type(), message = e.what();
  } catch (...) {
    type = current_exception_type(), message = "non-standard exception";
  }
  Message m;
  m.kind = FrameKind::Error;
  m.id = id;
  Writer w(m.body);
  w.put(static_cast<std::uint8_t>(code));
  w.put(self.name);
  w.put(std::string(function));
  w.put(type);
  w.put(message);
  conn->send(std::move(m));
}

void Runtime::Impl::fail_pending(int rank, std::exception_ptr error) {
  std::vector<Pending> failed;
  {
    std::lock_guard lock(pending_mutex);
    for (auto it = pending.begin(); it != pending.end();) {
      if (rank < 0 || it->second.dst == rank) {
        deadlines.erase(it->second.deadline);
        failed.push_back(std::move(it->second));
        it = pending.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& p : failed) {
    if (p.counted) calls_in_flight--;
    invoke_callback(p.callback, nullptr, error);
  }
}

bool Runtime::Impl::take_pending(std::uint64_t id, Pending& out) {
  auto it = pending.find(id);
  if (it == pending.end()) return false;
  deadlines.erase(it->second.deadline);
  out = std::move(it->second);
  pending.erase(it);
  return true;
}

void Runtime::Impl::arm_sweeper() {
  std::chrono::steady_clock::time_point next;
  {
    std::lock_guard lock(pending_mutex);
    if (deadlines.empty()) {
      armed_for = std::chrono::steady_clock::time_point::max();
      return;
    }
    next = armed_for = deadlines.begin()->first;
  }
  sweeper.expires_at(next);
  sweeper.async_wait([this](const asio::error_code& ec) {
    if (!ec) sweep();  // aborted: re-armed for an earlier deadline, or shutting down
  });
}

void Runtime::Impl::sweep() {
  std::vector<Pending> expired;
  {
    std::lock_guard lock(pending_mutex);
    const auto now = std::chrono::steady_clock::now();
    while (!deadlines.empty() && deadlines.begin()->first <= now) {
      Pending p;
      if (take_pending(deadlines.begin()->second, p)) expired.push_back(std::move(p));
      else deadlines.erase(deadlines.begin());  // never happens (both are erased together); never loop on it
    }
  }
  for (auto& p : expired) {
    if (p.counted) calls_in_flight--;
    invoke_callback(p.callback, nullptr,
                    std::make_exception_ptr(TimeoutError("call to '" + p.function + "' on worker '" + name_of(p.dst) +
                                                         "' timed out after " + std::to_string(p.timeout.count()) + " ms")));
  }
  arm_sweeper();
}

void Runtime::Impl::fail_all_pending(std::exception_ptr error) { fail_pending(-1, std::move(error)); }

void Runtime::Impl::mark_dead(int rank, const std::string& why) {
  std::vector<std::function<void(int, const std::string&)>> listeners;
  bool first;
  {
    std::lock_guard lock(conn_mutex);
    first = dead[rank].empty();
    if (first) dead[rank] = why;
  }
  if (!first) {
    // Already known dead, but calls may have slipped onto a fresh connection to it since: fail those too.
    fail_pending(rank, std::make_exception_ptr(ConnectionError("worker '" + name_of(rank) + "' (rank " +
                                                               std::to_string(rank) + ") is gone: " + dead[rank])));
    return;
  }
  {
    std::lock_guard lock(hooks_mutex);
    listeners = failure_listeners;
  }
  fail_pending(rank, std::make_exception_ptr(ConnectionError("worker '" + name_of(rank) + "' (rank " +
                                                             std::to_string(rank) + ") is gone: " + why)));
  for (auto& l : listeners) l(rank, why);
  check_rounds();
}

void Runtime::Impl::on_close(const std::shared_ptr<detail::Connection>& conn, const std::string& why) {
  const int rank = conn->peer_rank;
  bool was_closing;
  {
    std::lock_guard lock(conn_mutex);
    was_closing = closing;
    incoming.erase(conn);
    if (rank >= 0 && rank < static_cast<int>(outgoing.size()) && outgoing[rank] == conn) outgoing[rank] = nullptr;
  }
  if (!world_known) {
    if (self.rank == 0) {
      // A worker that registered and left before the world was complete: forget it, it may come back.
      std::lock_guard lock(conn_mutex);
      for (auto it = registrations.begin(); it != registrations.end(); ++it) {
        if (it->second.second == conn) {
          registrations.erase(it);
          break;
        }
      }
    } else if (conn->outgoing && rank == 0) {
      world_ready.set_error(ConnectionError("lost rank 0 during rendezvous: " + why));
    }
    return;
  }
  if (rank < 0) return;  // never said hello
  if (was_closing) return fail_pending(rank, std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
  // Our requests on that path cannot be answered any more: the peer is gone, on purpose or not.
  mark_dead(rank, conn->said_goodbye ? "it shut down" : why);
}

void Runtime::Impl::accept_loop() {
  acceptor.async_accept([this](const asio::error_code& ec, asio::ip::tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;  // closed: shutting down
    if (ec) {
      // A transient failure (a client that reset before we accepted it, a descriptor limit) must not stop us
      // accepting for good: try again shortly.
      accept_errors++;
      auto pause = std::make_shared<asio::steady_timer>(io, std::chrono::milliseconds(10));
      pause->async_wait([this, pause](const asio::error_code&) { accept_loop(); });
      return;
    }
    accepted++;
    auto conn = detail::make_tcp_connection(std::move(socket), options.limits, frame_handler(), close_handler());
    {
      std::lock_guard lock(conn_mutex);
      if (closing) return conn->close("shutting down");
      incoming.insert(conn);
    }
    accept_loop();
  });
}

void Runtime::Impl::check_rounds() {
  std::vector<bool> alive(world_size);
  {
    std::lock_guard lock(conn_mutex);
    for (int k = 0; k < world_size; ++k) alive[k] = dead[k].empty();
  }
  std::lock_guard lock(barrier_mutex);
  for (auto& [round, r] : rounds) {
    bool full = true;
    for (int k = 0; k < world_size && full; ++k) full = r.reports.count(k) || !alive[k];
    if (!full) continue;
    std::uint64_t total = 0;
    bool balanced = r.all_idle;
    for (auto& [i, ri] : r.reports) {
      for (auto& [j, rj] : r.reports) {
        if (!alive[i] || !alive[j] || ri.first.size() != static_cast<std::size_t>(world_size) ||
            rj.second.size() != static_cast<std::size_t>(world_size))
          continue;
        total += ri.first[j];
        balanced = balanced && ri.first[j] == rj.second[i];
      }
    }
    r.done.set_value(RoundResult{total, balanced});
  }
}

void Runtime::Impl::close_everything(bool say_goodbye) {
  std::vector<std::shared_ptr<detail::Connection>> conns;
  {
    std::lock_guard lock(conn_mutex);
    closing = true;
    for (auto& c : outgoing)
      if (c) conns.push_back(c);
    conns.insert(conns.end(), incoming.begin(), incoming.end());
  }
  // Before any connection closes, so that calls in flight fail as shut down, not as lost peers.
  fail_all_pending(std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
  for (auto& c : conns) {
    if (say_goodbye) {
      Message bye;
      bye.kind = FrameKind::Goodbye;
      c->send(std::move(bye));
    }
    c->close_when_flushed();
  }
  asio::post(io, [this] {
    asio::error_code ec;
    acceptor.close(ec);
  });
  // Give queued frames (replies, goodbyes) a moment to leave, then stop the network thread.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    {
      std::lock_guard lock(conn_mutex);
      bool open = !incoming.empty();
      for (auto& c : outgoing) open = open || (c && c->peer_rank != self.rank);
      if (!open) break;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  work.reset();
  io.stop();
  if (io_thread.joinable()) io_thread.join();
  pool->stop();
}

// ---- init / shutdown -----------------------------------------------------------------------------------------------

void init_rpc(std::string name, int rank, int world_size, RpcOptions options) {
  validate_worker_name(name);
  if (rank < 0) rank = env_int({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}, -1);
  if (world_size < 0) world_size = env_int({"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, -1);
  if (rank < 0 || world_size <= 0 || rank >= world_size)
    throw UsageError("init_rpc: need 0 <= rank < world_size (got rank " + std::to_string(rank) + ", world size " +
                     std::to_string(world_size) + "); set RANK and WORLD_SIZE or pass them");
  std::string host;
  int port = -1;
  if (options.init_method.rfind("tcp://", 0) == 0) {
    auto hp = options.init_method.substr(6);
    auto colon = hp.rfind(':');
    if (colon == std::string::npos) throw UsageError("init_method must be tcp://host:port");
    host = hp.substr(0, colon);
    port = std::atoi(hp.c_str() + colon + 1);
  } else if (options.init_method == "env://") {
    const char* a = std::getenv("MASTER_ADDR");
    host = a && *a ? a : "";
    port = env_int({"MASTER_PORT"}, -1);
    if (host.empty() || port <= 0) throw UsageError("init_method env:// needs MASTER_ADDR and MASTER_PORT");
  } else {
    throw UsageError("unknown init_method '" + options.init_method + "' (use env:// or tcp://host:port)");
  }
  if (port <= 0 || port > 65535) throw UsageError("invalid master port " + std::to_string(port));

  std::lock_guard lock(g_runtime_mutex);
  if (g_runtime) throw UsageError("init_rpc called twice: this process already runs a corpc runtime");
  auto impl = std::make_unique<Runtime::Impl>();
  impl->options = options;
  impl->self.name = std::move(name);
  impl->self.rank = rank;
  impl->world_size = world_size;
  impl->dead.assign(world_size, "");
  impl->outgoing.assign(world_size, nullptr);
  impl->sent_to = std::make_unique<std::atomic<std::uint64_t>[]>(world_size);
  impl->handled_from = std::make_unique<std::atomic<std::uint64_t>[]>(world_size);
  auto* raw = impl.get();
  auto rt = std::make_unique<Runtime>(std::move(impl));
  raw->start_threads();
  for (auto& init : runtime_initializers()) init(*rt);
  int listen_fd = -1;
  if (rank == 0) listen_fd = env_int({"CORPC_LISTEN_FD"}, -1);
  // Published before rendezvous ends: a peer that heard from rank 0 first may already be calling us, and its
  // requests run (after we have the table) with Runtime::get() working.
  g_runtime = std::move(rt);
  g_runtime_ptr.store(g_runtime.get(), std::memory_order_release);
  try {
    raw->rendezvous(host, static_cast<std::uint16_t>(port), listen_fd);
  } catch (...) {
    g_runtime_ptr.store(nullptr, std::memory_order_release);
    raw->close_everything(false);
    g_runtime.reset();
    throw;
  }
}

void shutdown(bool graceful) {
  std::lock_guard lock(g_runtime_mutex);
  if (!g_runtime) return;
  auto& impl = g_runtime->impl();
  if (graceful) {
    // Termination detection: rounds of (sent, handled, idle) summed on rank 0 until two rounds agree and balance.
    const auto limit = impl.options.shutdown_timeout.count() > 0 ? impl.options.shutdown_timeout
                                                                   : std::chrono::milliseconds(std::chrono::hours(24 * 365));
    const auto deadline = std::chrono::steady_clock::now() + limit;
    auto remaining = [&] {
      return std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1),
                                                 std::chrono::duration_cast<std::chrono::milliseconds>(
                                                     deadline - std::chrono::steady_clock::now()));
    };
    auto ask = [&](std::int64_t round, bool idle) {
      auto req = Runtime::begin_request("corpc::shutdown_round", 0);
      detail::encode_args<std::tuple<std::int64_t, int, std::vector<std::uint64_t>, std::vector<std::uint64_t>, bool>>(
          req, 0, round, impl.self.rank, impl.counts(impl.sent_to), impl.counts(impl.handled_from), idle);
      Promise<RoundResult> p;
      auto fut = p.get_future();
      auto shared = std::make_shared<Promise<RoundResult>>(std::move(p));
      g_runtime->call(0, std::move(req), with_timeout(remaining()), [shared](Message* reply, std::exception_ptr e) {
        if (e) return void(shared->set_exception(e));
        try {
          Reader r = Runtime::reply_reader(*reply, 0);
          shared->set_value(r.get<RoundResult>());
        } catch (...) {
          shared->set_exception(std::current_exception());
        }
      }, /*counted=*/false);
      return fut.wait();
    };
    auto locally_idle = [&] {
      std::function<bool()> probe;
      {
        std::lock_guard hl(impl.hooks_mutex);
        probe = impl.quiescence_probe;
      }
      return impl.calls_in_flight.load() == 0 && impl.handlers_running.load() == 0 && (!probe || probe());
    };
    try {
      ask(-1, true);  // everyone has reached shutdown
      std::optional<RoundResult> previous;
      for (std::int64_t round = 0; std::chrono::steady_clock::now() < deadline; ++round) {
        while (!locally_idle() && std::chrono::steady_clock::now() < deadline)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        auto result = ask(round, locally_idle());
        if (result.second && previous == result) break;  // quiet, and nothing moved since the last round
        previous = result;
      }
    } catch (const RpcError&) {
      // Rank 0 is gone or the deadline passed: close anyway rather than hang.
    }
  }
  impl.close_everything(true);
  g_runtime_ptr.store(nullptr, std::memory_order_release);
  g_runtime.reset();
}

WorkerInfo get_worker_info() { return Runtime::get().self(); }
WorkerInfo get_worker_info(const WorkerRef& worker) { return Runtime::get().worker(worker); }
std::vector<WorkerInfo> get_worker_infos() { return Runtime::get().workers(); }

}  // namespace corpc
