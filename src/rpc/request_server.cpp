// The request side (request_server.hpp).
#include "rpc/request_server.hpp"

#include "core/trace_recorder.hpp"
#include "rpc/call_engine.hpp"
#include "rpc/error_frames.hpp"

namespace corpc::detail {

namespace {

// One request being handled: owns what the reply needs, and guarantees the reply and the accounting happen once,
// even if the handler throws, its result fails to encode, or the handler is dropped without answering.
class RequestScope {
 public:
  RequestScope(RequestServer& server, std::shared_ptr<Connection> conn, const FrameHeader& h, const HandlerEntry& entry,
               std::stop_token stop)
      : server_(server),
        host_(server.host()),
        conn_(std::move(conn)),
        id_(h.id),
        src_(conn_->peer_rank),
        ctx_(h.context_id),
        counted_(!(h.flags & kFlagControl)),
        entry_(&entry),
        stop_(std::move(stop)),
        deadline_(h.deadline_ms ? Clock::now() + std::chrono::milliseconds(h.deadline_ms) : Clock::time_point::max()) {}
  RequestScope(RequestScope&& o) noexcept
      : server_(o.server_),
        host_(o.host_),
        conn_(std::move(o.conn_)),
        id_(o.id_),
        src_(o.src_),
        ctx_(o.ctx_),
        counted_(o.counted_),
        entry_(o.entry_),
        credit_(std::move(o.credit_)),
        stop_(std::move(o.stop_)),
        deadline_(o.deadline_),
        done_(std::exchange(o.done_, true)) {}

  // What the handler runs with: the caller's autograd context, this request's stop token and deadline.
  CallContext handler_context() const noexcept { return server_.handler_context(ctx_, stop_, deadline_); }
  bool stop_requested() const noexcept { return stop_.stop_requested(); }
  ~RequestScope() {
    if (!done_) fail(std::make_exception_ptr(RpcError("the handler finished without a reply")));
  }

  // Keeps the request's receive-budget reservation until it is answered.
  void hold(ReceiveCredit credit) noexcept { credit_ = std::move(credit); }

  void reply(Message&& out) noexcept {
    if (done_) return;
    try {
      out.head.kind = FrameKind::Response;
      out.head.id = id_;
      // Stamped in the caller's autograd context. A result that cannot be encoded becomes an error frame.
      OutFrame frame = [&] {
        CallContextScope scope(server_.handler_context(ctx_));
        return host_.frame_for(std::move(out), src_, *conn_);
      }();
      check_limits(frame, conn_->peer_limits, host_.name_of(src_));
      if (frame.staged) [[unlikely]] {  // CUDA tensors still being copied out: replied from the copy's completion
        auto self = std::make_shared<RequestScope>(std::move(*this));
        auto conn = self->conn_;
        return when_staged(
            conn, std::move(frame), [self](OutFrame&& f) { self->send_reply(std::move(f)); },
            [self](std::exception_ptr error) { self->fail(std::move(error)); });
      }
      send_reply(std::move(frame));
    } catch (...) {
      fail(std::current_exception());
    }
  }
  void send_reply(OutFrame&& frame) noexcept {
    try {
      {
        trace::detail::ScopedRecord slice(
            [&, bytes = frame.wire_bytes()] {
              return trace::detail::Record{.kind = trace::detail::Kind::reply_sent,
                                           .peer = src_,
                                           .request = id_,
                                           .bytes = bytes,
                                           .name = entry_->name};
            },
            counted_);
        conn_->send(std::move(frame));
      }
      finish();
    } catch (...) {
      fail(std::current_exception());
    }
  }
  void fail(std::exception_ptr error) noexcept {
    if (done_) return;
    try {
      server_.send_error(*conn_, id_, std::move(error), entry_->name, counted_);
    } catch (...) {
      conn_->close("cannot send an error reply");
    }
    finish();
  }

 private:
  void finish() noexcept {
    done_ = true;
    credit_.release();
    if (stop_.stop_possible()) CallEngine::of(*conn_).inbound().remove(id_);
    if (!counted_) return;
    host_.activity().request_handled(src_);
    host_.activity().handler_done();
  }

  RequestServer& server_;
  RequestHost& host_;
  std::shared_ptr<Connection> conn_;
  std::uint64_t id_;
  int src_;
  std::int64_t ctx_;
  bool counted_;
  const HandlerEntry* entry_;
  ReceiveCredit credit_;  // after conn_: released while the connection is still referenced
  std::stop_token stop_;  // empty for handlers that run to completion on the I/O thread: no cancel can reach them
  Clock::time_point deadline_;
  bool done_ = false;
};

// Runs `entry` on `msg` on the calling thread; the reply leaves from here, or when the handler's future completes.
void run_request(RequestHost& host, RequestScope scope, const HandlerEntry& entry, Message& msg, int src) {
  trace::detail::ScopedRecord slice(
      [&] {  // the handler's synchronous part (a coroutine's, up to its first suspension)
        return trace::detail::Record{.kind = trace::detail::Kind::run,
                                     .peer = src,
                                     .request = msg.head.id,
                                     .bytes = frame_bytes(msg.head),
                                     .name = entry.name};
      },
      !(msg.head.flags & kFlagControl));
  if (scope.stop_requested()) {  // cancelled before it started: dropped
    slice.finish();
    return scope.fail(cancelled_error());
  }
  try {
    CallContextScope ctx_scope(scope.handler_context());
    host.received_tensors(msg.head, src, msg.tensors);
    Inbound in{src, entry.name, Reader(msg.body.data(), msg.body.size()), &msg};
    in.args.tensors = &msg.tensors;
    in.args.peer = src;
    if (entry.run_sync) {
      Message out;
      entry.run_sync(in, out);
      slice.finish();  // before the reply: see ScopedRecord::finish
      scope.reply(std::move(out));
      return;
    }
    Future<Message> result = entry.run_async(in);
    slice.finish();
    if (result.done()) {
      if (auto e = result.error()) scope.fail(e);
      else scope.reply(std::move(result).value());
      return;
    }
    on_ready_inline(result, [scope = std::move(scope), result]() mutable {
      if (auto e = result.error()) scope.fail(e);
      else scope.reply(std::move(result).value());
    });
  } catch (...) {
    slice.finish();
    scope.fail(std::current_exception());
  }
}

// A request handed to the worker pool: owns its message until it runs.
struct PooledRequest : WorkItem {
  RequestHost& host;
  RequestScope scope;
  const HandlerEntry& entry;
  Message msg;
  int src;
  PooledRequest(RequestHost& h, RequestScope s, const HandlerEntry& e, Message&& m, int source)
      : host(h), scope(std::move(s)), entry(e), msg(std::move(m)), src(source) {
    run = [](WorkItem* w) noexcept {
      auto* self = static_cast<PooledRequest*>(w);
      run_request(self->host, std::move(self->scope), self->entry, self->msg, self->src);
      delete self;
    };
  }
};

}  // namespace

RequestServer::RequestServer(RequestHost& host) : host_(host) {}

void route_requests(FrameDispatcher& frames, RequestServer& server) {
  frames.on(Route::request,
            [&server](const std::shared_ptr<Connection>& c, Message&& m) { server.on_request(c, std::move(m)); });
  frames.on(Route::cancel,
            [&server](const std::shared_ptr<Connection>& c, Message&& m) { server.on_cancel(c, std::move(m)); });
  frames.on(Route::oversized,
            [&server](const std::shared_ptr<Connection>& c, Message&& m) { server.refuse_too_large(c, m.head); });
}

CallContext RequestServer::handler_context(std::int64_t context_id) const noexcept {
  CallContext c;
  if (const int slot = host_.autograd_context_slot(); slot >= 0) c.set(slot, context_id);
  return c;
}
CallContext RequestServer::handler_context(std::int64_t context_id, std::stop_token stop,
                                           Clock::time_point deadline) const noexcept {
  CallContext c = handler_context(context_id);
  c.set(call_bound_exempt_slot(), 1);
  c.stop = std::move(stop);
  c.deadline = deadline;
  return c;
}

// A request (or a cancel) is acted on once its sender has said who it is and the world table is known; until the
// table, it is parked (WorldGate) and comes back here. Parked first: a sender that heard from rank 0 before us sends
// its Hello and its first requests together, and the Hello waits for the table too (rendezvous.cpp), so until then
// a request behind it finds no rank on the connection yet. Refusing it then closed a healthy peer's connection, and
// lost us to it, whenever our table came late (a busy machine: issue 62).
bool RequestServer::admitted(const std::shared_ptr<Connection>& conn, Message& msg) {
  if (host_.park_until_world(conn, msg)) return false;
  if (conn->peer_rank < 0) {
    conn->close("protocol error: a request before hello");
    return false;
  }
  return true;
}

void RequestServer::on_request(const std::shared_ptr<Connection>& conn, Message&& msg) {
  if (!admitted(conn, msg)) return;
  const HandlerEntry* entry = host_.function(msg.head.function);
  if (!entry) {
    return refuse(*conn, msg.head,
                  std::make_exception_ptr(UnknownFunctionError(
                      "no function with id " + std::to_string(msg.head.function) + " is registered on worker '" +
                      host_.self_name() + "' (different binaries? register it by name)")),
                  "");
  }
  if (entry->signature != 0 && msg.head.signature != 0 && entry->signature != msg.head.signature) {
    return refuse(
        *conn, msg.head,
        std::make_exception_ptr(ArgumentTypeError("arguments do not match '" + entry->name + "' on worker '" +
                                                  host_.self_name() + "', which takes " + entry->signature_text)),
        entry->name);
  }
  if (!(msg.head.flags & kFlagControl)) host_.activity().handler_started();
  // A plain function on the I/O thread runs to completion before this thread could read a cancel: it needs no token.
  const bool runs_to_completion_here = entry->execution == Execution::io_thread && entry->run_sync;
  RequestScope scope(*this, conn, msg.head, *entry,
                     runs_to_completion_here ? std::stop_token() : CallEngine::of(*conn).inbound().add(msg.head.id));
  scope.hold(conn->take_receive_credit());
  const int src = conn->peer_rank;
  if (entry->execution == Execution::io_thread) {
    run_request(host_, std::move(scope), *entry, msg, src);
  } else {
    host_.pool().enqueue(new PooledRequest(host_, std::move(scope), *entry, std::move(msg), src));
  }
}

// Stops request `id` if its handler is still running (or queued): no reply, no count. Parked with the requests that
// come before the world table, so that it follows the request it cancels.
void RequestServer::on_cancel(const std::shared_ptr<Connection>& conn, Message&& msg) {
  if (admitted(conn, msg)) CallEngine::of(*conn).inbound().cancel(msg.head.id);
}

// A request whose header announced more than the receive budget: its bytes were dropped; answer it.
void RequestServer::refuse_too_large(const std::shared_ptr<Connection>& conn, const FrameHeader& h) {
  if (h.kind != FrameKind::Request || conn->peer_rank < 0) return conn->close("protocol error: an oversized frame");
  const std::uint64_t size = sizeof(FrameHeader) + std::uint64_t{h.meta_len} + h.body_len + h.tensor_bytes;
  refuse(*conn, h,
         std::make_exception_ptr(
             MessageTooLargeError("a request of " + std::to_string(size) + " bytes is over the " +
                                  std::to_string(host_.max_request_bytes()) + " that worker '" + host_.self_name() +
                                  "' may hold (its RpcOptions::receive_budget_per_connection / _per_process)")),
         "");
}

// A refused request still counts as handled: the caller counted it as sent, and graceful shutdown balances the two.
void RequestServer::refuse(Connection& conn, const FrameHeader& h, std::exception_ptr error,
                           std::string_view function) {
  const bool counted = !(h.flags & kFlagControl);
  send_error(conn, h.id, std::move(error), function, counted);
  if (counted) host_.activity().request_handled(conn.peer_rank);
}

void RequestServer::send_error(Connection& conn, std::uint64_t id, std::exception_ptr error, std::string_view function,
                               bool traced) {
  send_error_frame(conn, id, std::move(error), host_.self_name(), function, traced);
}

}  // namespace corpc::detail
