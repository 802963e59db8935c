// Outgoing calls: framing, checks, registration with a deadline, counting, sending; replies and timeouts.
#include <algorithm>

#include "corpc/rpc/outbound.hpp"
#include "memory/device_transfer.hpp"
#include "rpc/runtime_impl.hpp"
#include "core/trace_recorder.hpp"

namespace corpc {

namespace detail {
void start_call(OutboundCall&& call) noexcept {
  Runtime* rt = Runtime::try_get();
  if (!rt) {
    return call.complete(call.target, call.dst, nullptr,
                         std::make_exception_ptr(ShutdownError("corpc runtime is not running")));
  }
  try {
    runtime_impl(*rt).start_call(std::move(call));
  } catch (...) {
    // start_call completes the call itself once it is registered; anything thrown before that lands here.
    call.complete(call.target, call.dst, nullptr, std::current_exception());
  }
}
}  // namespace detail

void Runtime::Impl::stamp_autograd(detail::Message& m, int dst) const {
  m.head.context_id = outbound_context();
  m.head.message_id = -1;
  if (m.head.context_id != -1 && !m.tensors.empty() && tensor_hooks.on_send)
    m.head.message_id = tensor_hooks.on_send(m.head.context_id, dst, m.tensors);
}

void Runtime::Impl::attach_autograd(const detail::FrameHeader& h, int src, std::vector<at::Tensor>& tensors) const {
  if (h.context_id != -1 && h.message_id != -1 && !tensors.empty() && tensor_hooks.on_recv)
    tensor_hooks.on_recv(h.context_id, h.message_id, src, tensors);
}

namespace {
// Cancelling the future of a call (see CancelHook): the call is looked up by its connection and request id.
void cancel_call_hook(const detail::CancelHook& h) noexcept {
  if (Runtime* rt = Runtime::try_get())
    runtime_impl(*rt).cancel_call(static_cast<detail::Connection*>(h.p), static_cast<int>(h.a), h.b);
}
}  // namespace

// The timeout of a call issued now: the caller's, cut to what is left of the deadline of the call being handled.
std::chrono::milliseconds Runtime::Impl::effective_timeout(std::optional<std::chrono::milliseconds> asked) const {
  auto timeout = asked.value_or(options.rpc_timeout);
  const auto inherited = current_call_context().deadline;
  if (inherited != detail::Clock::time_point::max()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(inherited - detail::Clock::now());
    if (left <= std::chrono::milliseconds(0)) throw TimeoutError("the deadline of the call being handled has passed");
    timeout = std::min(timeout, left);
  }
  return timeout;
}

// Every step that can fail comes before the call is registered and counted: a failure then concerns this call alone.
void Runtime::Impl::start_call(detail::OutboundCall&& call) {
  // Shutdown's own rounds (control calls) are left out: they are what runs while the trace's parts are written.
  const std::int64_t trace_t0 = trace::enabled() && !call.control ? trace::now_ns() : 0;
  const int dst = call.dst;
  if (dst < 0 || dst >= world_size) throw UnknownWorkerError("no worker with rank " + std::to_string(dst));
  detail::Message& m = call.message;
  m.head.kind = detail::FrameKind::Request;
  m.head.flags = call.control ? detail::kFlagControl : 0;
  m.head.function = call.function_id;
  m.head.signature = call.signature;
  const auto timeout = effective_timeout(call.timeout);
  m.head.deadline_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(timeout.count(), 1, 0xffffffffLL));
  auto conn = connection_to(dst);  // throws for a dead peer or a closing runtime
  stamp_autograd(m, dst);
  detail::OutFrame frame = prepare_for(std::move(m), dst, conn.get());
  detail::check_limits(frame, conn->peer_limits, name_of(dst));
  detail::check_request_budget(frame, conn->peer_limits, name_of(dst));

  detail::PendingCall p;
  p.complete = call.complete;
  p.target = call.target;
  if (call.function_is_static) {
    p.function = call.function;
  } else {
    p.owned_name.assign(call.function);
  }
  p.sent_types = call.sent_types;
  p.deadline = detail::Clock::now() + timeout;
  p.timeout = timeout;
  p.dst = dst;
  p.counted = !call.control;
  bool earliest = false, send_now = true;
  // The per-peer limit bounds the program's own calls: not corpc's control calls, nor those of a handler or of the
  // runtime's bookkeeping (call_bound_exempt_slot). At it, a caller on a thread of its own (no executor: main, a
  // user's thread) blocks for room; anywhere else (a coroutine, an I/O thread) the call waits in the connection and
  // the caller goes on.
  const bool limited = !call.control && !detail::call_bound_exempt();
  const bool block = limited && current_executor() == nullptr && !blocking_forbidden();
  auto& calls = detail::calls_on(*conn);
  const std::uint64_t id = calls.pending.add(std::move(p), frame, limited, block, &earliest, &send_now);
  if (id == detail::PendingCalls::kClosed) {
    throw ConnectionError("worker '" + name_of(dst) + "' (rank " + std::to_string(dst) + ") is gone");
  }
  if (id == detail::PendingCalls::kNoRoom) {
    throw TimeoutError(timed_out_text(call.function, dst, timeout, true));
  }
  if (!call.control) activity->call_started();
  if (trace_t0) [[unlikely]] {  // before it leaves: its reply must not find this worker idle without the record
    trace::detail::record({.kind = trace::detail::Kind::call,
                           .peer = dst,
                           .t0 = trace_t0,
                           .t1 = trace::now_ns(),
                           .request = id,
                           .bytes = frame.wire_bytes(),
                           .name = std::string(call.function)});
  }
  if (earliest && calls.pending.earliest() < calls.timer_armed_for.load(std::memory_order_acquire)) {
    asio::post(conn->io(), [this, conn] { arm_deadline_timer(conn); });
  }
  if (send_now) send_request(conn, std::move(frame), !call.control);
  if (call.cancel) {
    detail::CancelHook hook;
    hook.fn = &cancel_call_hook;
    hook.p = conn.get();
    hook.a = static_cast<std::uint64_t>(dst);
    hook.b = id;
    call.cancel->arm_cancel(std::move(hook));
  }
}

// Completes a registered call that got no reply (cancelled, timed out, its connection lost). Its trace record goes
// first, before the call stops counting as in flight: a worker is never idle (and writing its trace) without it.
void Runtime::Impl::finish_without_reply(detail::PendingCall& p, std::exception_ptr error) noexcept {
  if (trace::enabled() && p.counted) [[unlikely]] {
    trace::detail::record({.kind = trace::detail::Kind::call_failed,
                           .peer = p.dst,
                           .t0 = trace::now_ns(),
                           .t1 = trace::now_ns(),
                           .request = p.id,
                           .name = std::string(p.function.empty() ? std::string_view(p.owned_name) : p.function)});
  }
  if (p.counted) activity->call_done();
  p.finish(nullptr, std::move(error));
}

detail::OutFrame Runtime::Impl::prepare_for(detail::Message&& m, int rank, detail::Connection* conn) const {
  if (rank < 0 || rank >= static_cast<int>(device_maps.size()) || rank >= static_cast<int>(workers.size()))
    return detail::prepare(std::move(m));
  // Only frames with CUDA tensors mapped to the peer can be lent anything: the others skip the link's lock.
  const bool lendable = conn && !device_maps[rank].empty() && !m.tensors.empty();
  return detail::prepare(std::move(m), device_maps[rank], workers[rank].name,
                         lendable ? conn->cuda_ipc_for_lending() : nullptr);
}

void Runtime::Impl::when_staged(const std::shared_ptr<detail::Connection>& conn, detail::OutFrame&& frame,
                                std::function<void(detail::OutFrame&&)> send,
                                std::function<void(std::exception_ptr)> failed) {
  if (!frame.staged) return send(std::move(frame));
  auto staged = frame.staged;
  auto held = std::make_shared<detail::OutFrame>(std::move(frame));
  // The continuation may run on a CUDA host-function thread: it only posts, and keeps no reference to the frame
  // there (its pinned memory must not be freed on that thread).
  staged->then([conn, held = std::move(held), send = std::move(send),
                failed = std::move(failed)](std::exception_ptr error) mutable {
    auto& io = conn->io();
    asio::post(io, [conn = std::move(conn), held = std::move(held), send = std::move(send), failed = std::move(failed),
                    error = std::move(error)]() mutable {
      held->staged.reset();
      if (error) return failed(std::move(error));
      send(std::move(*held));
    });
  });
}

// Fails call `id` on `conn` (if still pending) with `error`: its request never left.
void Runtime::Impl::fail_pending(const std::shared_ptr<detail::Connection>& conn, std::uint64_t id,
                                 std::exception_ptr error) {
  detail::PendingCall p;
  std::vector<detail::OutFrame> ready;
  if (detail::calls_on(*conn).pending.take(id, p, ready) != detail::PendingCalls::Lookup::Found) return;
  for (auto& f : ready) send_request(conn, std::move(f), true);
  finish_without_reply(p, std::move(error));
}

// Counted for graceful shutdown when it leaves: a call that waited for room and timed out was never sent.
void Runtime::Impl::send_request(const std::shared_ptr<detail::Connection>& conn, detail::OutFrame&& frame,
                                 bool counted) {
  if (frame.staged) [[unlikely]] {  // CUDA tensors still being copied out: sent from the copy's completion
    const std::uint64_t id = frame.head.id;
    return when_staged(
        conn, std::move(frame),
        [this, conn, counted](detail::OutFrame&& f) { send_request(conn, std::move(f), counted); },
        [this, conn, id](std::exception_ptr error) { fail_pending(conn, id, std::move(error)); });
  }
  if (counted) {
    activity->request_sent(conn->peer_rank);
  }
  try {
    conn->send(std::move(frame));
  } catch (const std::exception& e) {
    // Registered already: closing the connection fails the call (and nothing else may complete it twice).
    conn->close(std::string("send failed: ") + e.what());
  }
}

void Runtime::Impl::cancel_call(detail::Connection* where, int dst, std::uint64_t id) {
  auto conn = peers->outgoing_if(dst, where);
  if (!conn) return;  // the connection is gone, and every call on it failed with it
  detail::PendingCall p;
  std::vector<detail::OutFrame> ready;  // calls that waited for room, which the cancelled one frees
  if (detail::calls_on(*conn).pending.take(id, p, ready) != detail::PendingCalls::Lookup::Found)
    return;  // completed already
  for (auto& f : ready) send_request(conn, std::move(f), true);
  finish_without_reply(p, detail::cancelled_error());
  send_cancel(*conn, id);
}

// A cancel frame: a control request with no body, naming the request to stop. Best effort: the caller has its
// outcome already, and a callee that never gets it only works for nothing.
void Runtime::Impl::send_cancel(detail::Connection& conn, std::uint64_t id) noexcept {
  try {
    detail::Message m;
    m.head.kind = detail::FrameKind::Request;
    m.head.flags = detail::kFlagControl | detail::kFlagCancel;
    m.head.id = id;
    conn.send(detail::prepare(std::move(m)));
  } catch (...) {}
}

void Runtime::Impl::arm_deadline_timer(const std::shared_ptr<detail::Connection>& conn) {
  auto& calls = detail::calls_on(*conn);
  const auto next = calls.pending.earliest();
  if (next == detail::Clock::time_point::max() || next >= calls.timer_armed_for.load()) return;
  calls.timer_armed_for.store(next);
  calls.deadline_timer.expires_at(next);
  calls.deadline_timer.async_wait([this, weak = std::weak_ptr(conn)](const asio::error_code& ec) {
    auto c = weak.lock();
    if (ec || !c) return;  // re-armed for an earlier deadline, or gone
    auto& calls = detail::calls_on(*c);
    calls.timer_armed_for.store(detail::Clock::time_point::max());
    std::vector<detail::PendingCall> expired;
    std::vector<detail::OutFrame> ready;
    calls.pending.take_expired(detail::Clock::now(), expired, ready);
    for (auto& f : ready) send_request(c, std::move(f), true);
    for (auto& p : expired) {
      if (!p.unsent) send_cancel(*c, p.id);  // expiry stops the work on the callee too
      finish_without_reply(p, timed_out(p));
    }
    arm_deadline_timer(c);
  });
}

std::string Runtime::Impl::timed_out_text(std::string_view function, int dst, std::chrono::milliseconds timeout,
                                          bool unsent) const {
  std::string text = "call to '" + std::string(function) + "' on worker '" + name_of(dst) + "' timed out after " +
                     std::to_string(timeout.count()) + " ms";
  if (unsent)
    text += " unsent, waiting for room under RpcOptions::max_calls_in_flight_per_peer (" +
            std::to_string(options.max_calls_in_flight_per_peer) + " unanswered calls to it)";
  return text;
}

std::exception_ptr Runtime::Impl::timed_out(const detail::PendingCall& p) const {
  return std::make_exception_ptr(
      TimeoutError(timed_out_text(p.function.empty() ? p.owned_name : p.function, p.dst, p.timeout, p.unsent)));
}

void Runtime::Impl::deliver_reply(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  if (!conn->outgoing) return conn->close("protocol error: a reply on a connection that carries no calls of ours");
  detail::PendingCall p;
  std::vector<detail::OutFrame> ready;  // a call that waited for room, now sent (allocates only then)
  switch (detail::calls_on(*conn).pending.take(msg.head.id, p, ready)) {
    case detail::PendingCalls::Lookup::Late: return;  // timed out, or failed with its peer, already
    case detail::PendingCalls::Lookup::NeverIssued:
      return conn->close("protocol error: a reply to request " + std::to_string(msg.head.id) + ", never sent");
    case detail::PendingCalls::Lookup::Found: break;
  }
  for (auto& f : ready) send_request(conn, std::move(f), true);
  const std::string_view function = p.function.empty() ? std::string_view(p.owned_name) : p.function;
  if (trace::enabled() && p.counted) [[unlikely]] {  // before call_done: see finish_without_reply
    trace::detail::record({.kind = trace::detail::Kind::reply_received,
                           .error = msg.head.kind == detail::FrameKind::Error,
                           .peer = p.dst,
                           .t0 = trace::now_ns(),
                           .t1 = trace::now_ns(),
                           .request = p.id,
                           .bytes = detail::frame_bytes(msg.head),
                           .name = std::string(function)});
  }
  if (p.counted) activity->call_done();
  if (msg.head.kind == detail::FrameKind::Error) {
    // Past its deadline the call has timed out, whatever the error: with an inherited deadline the callee's own
    // nested call fails at the same moment, and its error may arrive before our deadline timer has run.
    if (detail::Clock::now() >= p.deadline) return p.finish(nullptr, timed_out(p));
    auto error = decode_error(msg, name_of(p.dst), function);
    // The callee knows only a hash of what was sent: the types themselves are known here.
    if (!p.sent_types.empty()) {
      try {
        std::rethrow_exception(error);
      } catch (const ArgumentTypeError& e) {
        error = std::make_exception_ptr(
            ArgumentTypeError(std::string(e.what()) + "; this call sent " + std::string(p.sent_types)));
      } catch (...) {}
    }
    return p.finish(nullptr, std::move(error));
  }
  try {
    attach_autograd(msg.head, p.dst, msg.tensors);
  } catch (...) {
    return p.finish(nullptr, std::current_exception());
  }
  p.finish(&msg, nullptr);
}

void Runtime::Impl::fail_calls(detail::Connection& conn, std::exception_ptr error) {
  std::vector<detail::PendingCall> failed;
  detail::calls_on(conn).pending.close_and_take_all(failed);
  for (auto& p : failed) finish_without_reply(p, error);
}

}  // namespace corpc
