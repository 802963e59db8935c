// A connection's calls: starting them, their replies, deadlines and cancellation (call_engine.hpp).
#include "rpc/call_engine.hpp"

#include <algorithm>

#include "core/trace_recorder.hpp"
#include "memory/device_transfer.hpp"
#include "rpc/error_frames.hpp"

namespace corpc::detail {

CallEngine::CallEngine(asio::io_context& io, CallHost& host, std::size_t max_in_flight, bool dialed)
    : RpcSession(dialed), host_(host), max_in_flight_(max_in_flight), deadline_timer_(io) {
  pending_.set_limit(max_in_flight);
}

SessionFactory CallEngine::factory(CallHost& host, std::size_t max_in_flight, bool dialed) {
  return [&host, max_in_flight, dialed](asio::io_context& io) -> std::unique_ptr<ConnectionSession> {
    return std::make_unique<CallEngine>(io, host, max_in_flight, dialed);
  };
}

// The timeout of a call issued now: the caller's, cut to what is left of the deadline of the call being handled.
std::chrono::milliseconds CallEngine::effective_timeout(std::optional<std::chrono::milliseconds> asked) const {
  auto timeout = asked.value_or(host_.default_timeout());
  const auto inherited = current_call_context().deadline;
  if (inherited != Clock::time_point::max()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(inherited - Clock::now());
    if (left <= std::chrono::milliseconds(0)) throw TimeoutError("the deadline of the call being handled has passed");
    timeout = std::min(timeout, left);
  }
  return timeout;
}

void CallEngine::start(const std::shared_ptr<Connection>& conn, OutboundCall&& call) {
  // Shutdown's own rounds (control calls) are left out: they are what runs while the trace's parts are written.
  const std::int64_t trace_t0 = trace::enabled() && !call.control ? trace::now_ns() : 0;
  const int dst = call.dst;
  Message& m = call.message;
  m.head.kind = FrameKind::Request;
  m.head.flags = call.control ? kFlagControl : 0;
  m.head.function = call.function_id;
  m.head.signature = call.signature;
  const auto timeout = effective_timeout(call.timeout);
  m.head.deadline_ms = static_cast<std::uint32_t>(std::clamp<std::int64_t>(timeout.count(), 1, 0xffffffffLL));
  OutFrame frame = host_.frame_for(std::move(m), dst, *conn);
  frame.send_now = call.send_now;
  {
    const std::string receiver = host_.name_of(dst);
    check_limits(frame, conn->peer_limits, receiver);
    check_request_budget(frame, conn->peer_limits, receiver);
  }

  PendingCall p;
  p.complete = call.complete;
  p.target = call.target;
  if (call.function_is_static) {
    p.function = call.function;
  } else {
    p.owned_name.assign(call.function);
  }
  p.sent_types = call.sent_types;
  p.deadline = Clock::now() + timeout;
  p.timeout = timeout;
  p.dst = dst;
  p.counted = !call.control;
  bool earliest = false, send_now = true;
  // The per-peer limit bounds the program's own calls: not corpc's control calls, nor those of a handler or of the
  // runtime's bookkeeping (call_bound_exempt_slot). At it, a caller on a thread of its own (no executor: main, a
  // user's thread) blocks for room; anywhere else (a coroutine, an I/O thread) the call waits here and the caller
  // goes on.
  const bool limited = !call.control && !call_bound_exempt();
  const bool block = limited && current_executor() == nullptr && !blocking_forbidden();
  const std::uint64_t id = pending_.add(std::move(p), frame, limited, block, &earliest, &send_now);
  if (id == PendingCalls::kClosed) {
    throw ConnectionError("worker '" + host_.name_of(dst) + "' (rank " + std::to_string(dst) + ") is gone");
  }
  if (id == PendingCalls::kNoRoom) throw TimeoutError(timed_out_text(call.function, dst, timeout, true));
  // Registered: from here on every outcome reaches call.complete, and nothing throws.
  if (!call.control) host_.activity().call_started();
  if (trace_t0) [[unlikely]] {  // before it leaves: its reply must not find this worker idle without the record
    trace::detail::record({.kind = trace::detail::Kind::call,
                           .peer = dst,
                           .t0 = trace_t0,
                           .t1 = trace::now_ns(),
                           .request = id,
                           .bytes = frame.wire_bytes(),
                           .name = std::string(call.function)});
  }
  if (earliest && pending_.earliest() < timer_armed_for_.load(std::memory_order_acquire)) {
    asio::post(conn->io(), [this, conn] { arm_deadline_timer(conn); });
  }
  if (send_now) send(conn, std::move(frame), !call.control);
  if (call.cancel) host_.arm_cancel(*call.cancel, *conn, id);
}

void CallEngine::on_reply(const std::shared_ptr<Connection>& conn, Message&& msg) {
  if (!outgoing) return conn->close("protocol error: a reply on a connection that carries no calls of ours");
  PendingCall p;
  std::vector<OutFrame> ready;  // a call that waited for room, now sent (allocates only then)
  switch (pending_.take(msg.head.id, p, ready)) {
    case PendingCalls::Lookup::Late: return;  // timed out, or failed with its peer, already
    case PendingCalls::Lookup::NeverIssued:
      return conn->close("protocol error: a reply to request " + std::to_string(msg.head.id) + ", never sent");
    case PendingCalls::Lookup::Found: break;
  }
  send_all(conn, ready);
  const std::string_view function = p.function.empty() ? std::string_view(p.owned_name) : p.function;
  if (trace::enabled() && p.counted) [[unlikely]] {  // before call_done: see finish_without_reply
    trace::detail::record({.kind = trace::detail::Kind::reply_received,
                           .error = msg.head.kind == FrameKind::Error,
                           .peer = p.dst,
                           .t0 = trace::now_ns(),
                           .t1 = trace::now_ns(),
                           .request = p.id,
                           .bytes = frame_bytes(msg.head),
                           .name = std::string(function)});
  }
  if (p.counted) host_.activity().call_done();
  if (msg.head.kind == FrameKind::Error) {
    // Past its deadline the call has timed out, whatever the error: with an inherited deadline the callee's own
    // nested call fails at the same moment, and its error may arrive before our deadline timer has run.
    if (Clock::now() >= p.deadline) return p.finish(nullptr, timed_out(p));
    auto error = decode_error(msg, host_.name_of(p.dst), function);
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
    host_.received_tensors(msg.head, p.dst, msg.tensors);
  } catch (...) {
    return p.finish(nullptr, std::current_exception());
  }
  p.finish(&msg, nullptr);
}

void CallEngine::cancel(const std::shared_ptr<Connection>& conn, std::uint64_t id) {
  if (fail_call(conn, id, cancelled_error())) send_cancel(*conn, id);  // not if it completed already
}

bool CallEngine::fail_call(const std::shared_ptr<Connection>& conn, std::uint64_t id, std::exception_ptr error) {
  PendingCall p;
  std::vector<OutFrame> ready;  // calls that waited for room, which this one frees
  if (pending_.take(id, p, ready) != PendingCalls::Lookup::Found) return false;
  send_all(conn, ready);
  finish_without_reply(p, std::move(error));
  return true;
}

void CallEngine::closed(std::exception_ptr error) {
  std::vector<PendingCall> failed;
  pending_.close_and_take_all(failed);
  for (auto& p : failed) finish_without_reply(p, error);
  inbound_.cancel_all();  // nobody waits for the replies of the peer's requests any more
}

// Counted for graceful shutdown when it leaves: a call that waited for room and timed out was never sent.
void CallEngine::send(const std::shared_ptr<Connection>& conn, OutFrame&& frame, bool counted) {
  if (frame.staged) [[unlikely]] {  // CUDA tensors still being copied out: sent from the copy's completion
    const std::uint64_t id = frame.head.id;
    return when_staged(
        conn, std::move(frame), [this, conn, counted](OutFrame&& f) { send(conn, std::move(f), counted); },
        [this, conn, id](std::exception_ptr error) { fail_call(conn, id, std::move(error)); });
  }
  if (counted) host_.activity().request_sent(conn->peer_rank);
  try {
    conn->send(std::move(frame));
  } catch (const std::exception& e) {
    // Registered already: closing the connection fails the call (and nothing else may complete it twice).
    conn->close(std::string("send failed: ") + e.what());
  }
}

void CallEngine::send_all(const std::shared_ptr<Connection>& conn, std::vector<OutFrame>& ready) {
  for (auto& f : ready) send(conn, std::move(f), true);
}

// Completes a registered call that got no reply (cancelled, timed out, its connection lost). Its trace record goes
// first, before the call stops counting as in flight: a worker is never idle (and writing its trace) without it.
void CallEngine::finish_without_reply(PendingCall& p, std::exception_ptr error) noexcept {
  if (trace::enabled() && p.counted) [[unlikely]] {
    trace::detail::record({.kind = trace::detail::Kind::call_failed,
                           .peer = p.dst,
                           .t0 = trace::now_ns(),
                           .t1 = trace::now_ns(),
                           .request = p.id,
                           .name = std::string(p.function.empty() ? std::string_view(p.owned_name) : p.function)});
  }
  if (p.counted) host_.activity().call_done();
  p.finish(nullptr, std::move(error));
}

// A cancel frame: a control request with no body, naming the request to stop. Best effort: the caller has its
// outcome already, and a callee that never gets it only works for nothing.
void CallEngine::send_cancel(Connection& conn, std::uint64_t id) noexcept {
  try {
    Message m;
    m.head.kind = FrameKind::Request;
    m.head.flags = kFlagControl | kFlagCancel;
    m.head.id = id;
    conn.send(prepare(std::move(m)));
  } catch (...) {}
}

void CallEngine::arm_deadline_timer(const std::shared_ptr<Connection>& conn) {
  const auto next = pending_.earliest();
  if (next == Clock::time_point::max() || next >= timer_armed_for_.load()) return;
  timer_armed_for_.store(next);
  deadline_timer_.expires_at(next);
  // The timer is this engine's, and the engine the connection's: a weak reference to the connection keeps both.
  deadline_timer_.async_wait([this, weak = std::weak_ptr(conn)](const asio::error_code& ec) {
    auto c = weak.lock();
    if (ec || !c) return;  // re-armed for an earlier deadline, or gone
    timer_armed_for_.store(Clock::time_point::max());
    std::vector<PendingCall> expired;
    std::vector<OutFrame> ready;
    pending_.take_expired(Clock::now(), expired, ready);
    send_all(c, ready);
    for (auto& p : expired) {
      if (!p.unsent) send_cancel(*c, p.id);  // expiry stops the work on the callee too
      finish_without_reply(p, timed_out(p));
    }
    arm_deadline_timer(c);
  });
}

std::string CallEngine::timed_out_text(std::string_view function, int dst, std::chrono::milliseconds timeout,
                                       bool unsent) const {
  std::string text = "call to '" + std::string(function) + "' on worker '" + host_.name_of(dst) + "' timed out after " +
                     std::to_string(timeout.count()) + " ms";
  if (unsent)
    text += " unsent, waiting for room under RpcOptions::max_calls_in_flight_per_peer (" +
            std::to_string(max_in_flight_) + " unanswered calls to it)";
  return text;
}

std::exception_ptr CallEngine::timed_out(const PendingCall& p) const {
  return std::make_exception_ptr(
      TimeoutError(timed_out_text(p.function.empty() ? p.owned_name : p.function, p.dst, p.timeout, p.unsent)));
}

void when_staged(const std::shared_ptr<Connection>& conn, OutFrame&& frame, std::function<void(OutFrame&&)> send,
                 std::function<void(std::exception_ptr)> failed) {
  if (!frame.staged) return send(std::move(frame));
  auto staged = frame.staged;
  auto held = std::make_shared<OutFrame>(std::move(frame));
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

}  // namespace corpc::detail
