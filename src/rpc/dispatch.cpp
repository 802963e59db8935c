// Incoming frames: requests are looked up by id and run where their function says (on this I/O thread, or on the
// worker pool); every request ends in exactly one reply or error frame, and in exactly one count for shutdown.
// Cancellation: a handler that may outlive the frame's dispatch (on the pool, or a coroutine) runs with a stop token
// registered in the connection's InboundCalls, which a cancel frame (or the connection's loss) stops; a request
// stopped before it started is answered with CancelledError without running.
#include "corpc/core/type_name.hpp"
#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"
#include "memory/device_transfer.hpp"
#include "rpc/runtime_impl.hpp"
#include "core/trace_recorder.hpp"

namespace corpc {

namespace {

// One request being handled: owns what the reply needs, and guarantees the reply and the accounting happen once,
// even if the handler throws, its result fails to encode, or the handler is dropped without answering.
class RequestScope {
 public:
  RequestScope(Runtime::Impl& rt, std::shared_ptr<detail::Connection> conn, const detail::FrameHeader& h,
               const detail::HandlerEntry& entry, std::stop_token stop)
      : rt_(rt),
        conn_(std::move(conn)),
        id_(h.id),
        src_(conn_->peer_rank),
        ctx_(h.context_id),
        counted_(!(h.flags & detail::kFlagControl)),
        entry_(&entry),
        stop_(std::move(stop)),
        deadline_(h.deadline_ms ? detail::Clock::now() + std::chrono::milliseconds(h.deadline_ms)
                                : detail::Clock::time_point::max()) {}
  RequestScope(RequestScope&& o) noexcept
      : rt_(o.rt_),
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
  CallContext handler_context() const noexcept { return rt_.handler_context(ctx_, stop_, deadline_); }
  bool stop_requested() const noexcept { return stop_.stop_requested(); }
  ~RequestScope() {
    if (!done_) fail(std::make_exception_ptr(RpcError("the handler finished without a reply")));
  }

  // Keeps the request's receive-budget reservation until it is answered.
  void hold(detail::ReceiveCredit credit) noexcept { credit_ = std::move(credit); }

  void reply(detail::Message&& out) noexcept {
    if (done_) return;
    try {
      out.head.kind = detail::FrameKind::Response;
      out.head.id = id_;
      {
        CallContextScope scope(rt_.handler_context(ctx_));
        rt_.stamp_autograd(out, src_);
      }
      // A result that cannot be encoded becomes an error frame.
      detail::OutFrame frame = rt_.prepare_for(std::move(out), src_, conn_.get());
      detail::check_limits(frame, conn_->peer_limits, rt_.name_of(src_));
      if (frame.staged) [[unlikely]] {  // CUDA tensors still being copied out: replied from the copy's completion
        auto self = std::make_shared<RequestScope>(std::move(*this));
        auto conn = self->conn_;
        return rt_.when_staged(
            conn, std::move(frame), [self](detail::OutFrame&& f) { self->send_reply(std::move(f)); },
            [self](std::exception_ptr error) { self->fail(std::move(error)); });
      }
      send_reply(std::move(frame));
    } catch (...) {
      fail(std::current_exception());
    }
  }
  void send_reply(detail::OutFrame&& frame) noexcept {
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
      rt_.send_error(conn_, id_, std::move(error), entry_->name, counted_);
    } catch (...) {
      conn_->close("cannot send an error reply");
    }
    finish();
  }

 private:
  void finish() noexcept {
    done_ = true;
    credit_.release();
    if (stop_.stop_possible()) detail::calls_on(*conn_).inbound.remove(id_);
    if (!counted_) return;
    rt_.activity->request_handled(src_);
    rt_.activity->handler_done();
  }

  Runtime::Impl& rt_;
  std::shared_ptr<detail::Connection> conn_;
  std::uint64_t id_;
  int src_;
  std::int64_t ctx_;
  bool counted_;
  const detail::HandlerEntry* entry_;
  detail::ReceiveCredit credit_;  // after conn_: released while the connection is still referenced
  std::stop_token stop_;  // empty for handlers that run to completion on the I/O thread: no cancel can reach them
  detail::Clock::time_point deadline_;
  bool done_ = false;
};

// Runs `entry` on `msg` on the calling thread; the reply leaves from here, or when the handler's future completes.
void run_request(Runtime::Impl& rt, RequestScope scope, const detail::HandlerEntry& entry, detail::Message& msg,
                 int src) {
  trace::detail::ScopedRecord slice(
      [&] {  // the handler's synchronous part (a coroutine's, up to its first suspension)
        return trace::detail::Record{.kind = trace::detail::Kind::run,
                                     .peer = src,
                                     .request = msg.head.id,
                                     .bytes = detail::frame_bytes(msg.head),
                                     .name = entry.name};
      },
      !(msg.head.flags & detail::kFlagControl));
  if (scope.stop_requested()) {  // cancelled before it started: dropped
    slice.finish();
    return scope.fail(detail::cancelled_error());
  }
  try {
    CallContextScope ctx_scope(scope.handler_context());
    rt.attach_autograd(msg.head, src, msg.tensors);
    detail::Inbound in{src, entry.name, Reader(msg.body.data(), msg.body.size()), &msg};
    in.args.tensors = &msg.tensors;
    in.args.peer = src;
    if (entry.run_sync) {
      detail::Message out;
      entry.run_sync(in, out);
      slice.finish();  // before the reply: see ScopedRecord::finish
      scope.reply(std::move(out));
      return;
    }
    Future<detail::Message> result = entry.run_async(in);
    slice.finish();
    if (result.done()) {
      if (auto e = result.error()) scope.fail(e);
      else scope.reply(std::move(result).value());
      return;
    }
    detail::on_ready_inline(result, [scope = std::move(scope), result]() mutable {
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
  Runtime::Impl& rt;
  RequestScope scope;
  const detail::HandlerEntry& entry;
  detail::Message msg;
  int src;
  PooledRequest(Runtime::Impl& r, RequestScope s, const detail::HandlerEntry& e, detail::Message&& m, int source)
      : rt(r), scope(std::move(s)), entry(e), msg(std::move(m)), src(source) {
    run = [](WorkItem* w) noexcept {
      auto* self = static_cast<PooledRequest*>(w);
      run_request(self->rt, std::move(self->scope), self->entry, self->msg, self->src);
      delete self;
    };
  }
};

}  // namespace

CallContext Runtime::Impl::handler_context(std::int64_t context_id) const noexcept {
  CallContext c;
  if (tensor_hooks.context_slot >= 0) c.set(tensor_hooks.context_slot, context_id);
  return c;
}
CallContext Runtime::Impl::handler_context(std::int64_t context_id, std::stop_token stop,
                                           detail::Clock::time_point deadline) const noexcept {
  CallContext c = handler_context(context_id);
  c.set(detail::call_bound_exempt_slot(), 1);
  c.stop = std::move(stop);
  c.deadline = deadline;
  return c;
}

void Runtime::Impl::on_frame(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  if (conn->hello_refused) return;  // closing once our refusal is out: nothing it says counts
  if (conn->delivering_refused()) return refuse_too_large(conn, msg.head);
  if (!msg.devices.empty()) [[unlikely]]
    return deliver_on_devices(conn, std::move(msg));
  switch (msg.head.kind) {
    case detail::FrameKind::Hello: return on_hello(conn, std::move(msg));
    case detail::FrameKind::World:
      // Only rank 0 publishes the table, on the connection we registered through.
      if (!conn->outgoing || conn->peer_rank != 0) return conn->close("protocol error: a world table not from rank 0");
      return on_world(std::move(msg));
    case detail::FrameKind::Request: return on_request(conn, std::move(msg));
    case detail::FrameKind::Response:
    case detail::FrameKind::Error: {
      if (msg.head.id == 0 && msg.head.kind == detail::FrameKind::Error) {  // the peer refused the connection itself
        std::string why = "refused by peer";
        try {
          std::rethrow_exception(decode_error(msg, name_of(conn->peer_rank), "rendezvous"));
        } catch (const std::exception& e) {
          why = e.what();
        }
        if (!world_ready.get_future().done()) world_ready.set_exception(RpcError("rendezvous refused: " + why));
        return conn->close(why);
      }
      return deliver_reply(conn, std::move(msg));
    }
    case detail::FrameKind::IpcDone: return on_ipc_done(conn, std::move(msg));
    case detail::FrameKind::Goodbye: {
      // A body says the peer stops after an error; on_close words its departure with it. Bounded: it is only words.
      const int rank = conn->peer_rank;
      if (!msg.body.empty()) peers->set_farewell(rank, msg.body.substr(0, 4096));
      return;
    }
    case detail::FrameKind::Ping:  // answered by the transport
    case detail::FrameKind::Pong: return;
  }
}

// The copies to the devices run on the devices' transfer streams; the message is delivered from their completion, on
// this connection's I/O thread. A failure answers a request with an error, or fails the call a reply was for.
void Runtime::Impl::deliver_on_devices(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  // A request's share of the receive budget stays reserved until it is delivered.
  auto credit = std::make_shared<detail::ReceiveCredit>(conn->take_receive_credit());
  auto transfer = std::make_shared<detail::DeviceTransfer>();
  auto held = std::make_shared<detail::Message>(std::move(msg));
  try {
    detail::cuda::upload(held->tensors, held->devices, transfer, held->ipc.get());
  } catch (...) {
    transfer->fail(std::current_exception());
  }
  transfer->seal();
  transfer->then([this, conn, held = std::move(held), credit = std::move(credit)](std::exception_ptr error) mutable {
    auto& io = conn->io();  // from a CUDA host function: post, and keep nothing there
    asio::post(io, [this, conn = std::move(conn), held = std::move(held), credit = std::move(credit),
                    error = std::move(error)]() mutable {
      held->devices.clear();
      if (held->ipc) {
        // Every copy out of the lender's memory is done (or never started): its tensors may go back. A connection
        // lost meanwhile released them on the lender's side, which may have reused the memory under the copy.
        return_ipc_loans(conn, *held->ipc);
        if (!error && held->ipc->link && held->ipc->link->closed())
          error =
              std::make_exception_ptr(ConnectionError("the connection was lost while a CUDA IPC tensor was copied"));
        held->ipc.reset();
      }
      if (!error) return on_frame(conn, std::move(*held));
      const detail::FrameHeader& h = held->head;
      if (h.kind == detail::FrameKind::Request) {
        send_error(conn, h.id, std::move(error), "(delivery to a CUDA device)", !(h.flags & detail::kFlagControl));
        if (!(h.flags & detail::kFlagControl)) activity->request_handled(conn->peer_rank);
      } else if (conn->outgoing) {
        fail_pending(conn, h.id, std::move(error));
      }
    });
  });
}

void Runtime::Impl::on_request(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  if (conn->peer_rank < 0) return conn->close("protocol error: a request before hello");
  if (world.park_if_unknown(conn, msg)) return;
  // A cancel frame: stops request `id` if its handler is still running (or queued); no reply, no count.
  if (msg.head.flags & detail::kFlagCancel) return detail::calls_on(*conn).inbound.cancel(msg.head.id);
  const detail::HandlerEntry* entry = detail::global_registry().find(msg.head.function);
  // A refused request still counts as handled: the caller counted it as sent, and graceful shutdown balances the two.
  auto refuse = [&](std::exception_ptr error, std::string_view function) {
    send_error(conn, msg.head.id, std::move(error), function, !(msg.head.flags & detail::kFlagControl));
    if (!(msg.head.flags & detail::kFlagControl)) activity->request_handled(conn->peer_rank);
  };
  if (!entry) {
    return refuse(std::make_exception_ptr(UnknownFunctionError(
                      "no function with id " + std::to_string(msg.head.function) + " is registered on worker '" +
                      self.name + "' (different binaries? register it by name)")),
                  "");
  }
  if (entry->signature != 0 && msg.head.signature != 0 && entry->signature != msg.head.signature) {
    return refuse(std::make_exception_ptr(ArgumentTypeError("arguments do not match '" + entry->name + "' on worker '" +
                                                            self.name + "', which takes " + entry->signature_text)),
                  entry->name);
  }
  if (!(msg.head.flags & detail::kFlagControl)) activity->handler_started();
  // A plain function on the I/O thread runs to completion before this thread could read a cancel: it needs no token.
  const bool runs_to_completion_here = entry->execution == Execution::io_thread && entry->run_sync;
  RequestScope scope(*this, conn, msg.head, *entry,
                     runs_to_completion_here ? std::stop_token() : detail::calls_on(*conn).inbound.add(msg.head.id));
  scope.hold(conn->take_receive_credit());
  const int src = conn->peer_rank;
  if (entry->execution == Execution::io_thread) {
    run_request(*this, std::move(scope), *entry, msg, src);
  } else {
    pool->enqueue(new PooledRequest(*this, std::move(scope), *entry, std::move(msg), src));
  }
}

void Runtime::Impl::refuse_too_large(const std::shared_ptr<detail::Connection>& conn, const detail::FrameHeader& h) {
  if (h.kind != detail::FrameKind::Request || conn->peer_rank < 0)
    return conn->close("protocol error: an oversized frame");
  const std::uint64_t size = sizeof(detail::FrameHeader) + std::uint64_t{h.meta_len} + h.body_len + h.tensor_bytes;
  send_error(conn, h.id,
             std::make_exception_ptr(
                 MessageTooLargeError("a request of " + std::to_string(size) + " bytes is over the " +
                                      std::to_string(options.limits.max_request_bytes) + " that worker '" + self.name +
                                      "' may hold (its RpcOptions::receive_budget_per_connection / _per_process)")),
             "", !(h.flags & detail::kFlagControl));
  if (!(h.flags & detail::kFlagControl)) activity->request_handled(conn->peer_rank);
}

void Runtime::Impl::send_error(const std::shared_ptr<detail::Connection>& conn, std::uint64_t id,
                               std::exception_ptr error, std::string_view function, bool traced) {
  detail::OutFrame frame = detail::prepare(error_frame(id, std::move(error), self.name, function));
  trace::detail::ScopedRecord slice(
      [&, bytes = frame.wire_bytes()] {
        return trace::detail::Record{.kind = trace::detail::Kind::reply_sent,
                                     .error = true,
                                     .peer = conn->peer_rank,
                                     .request = id,
                                     .bytes = bytes,
                                     .name = std::string(function)};
      },
      traced);
  conn->send(std::move(frame));
}

}  // namespace corpc
