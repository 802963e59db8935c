// A connection's calls, both ways: ours that await replies on it (their ids, deadlines, the per-peer limit,
// cancellation) and the peer's requests running here that a cancel frame can still stop. One per connection, kept
// as its session (transport/connection.hpp) with the rest of what the runtime knows of it (rpc_session.hpp), so it
// lives exactly as long as the connection.
//
// A call's walk: start() frames the call for the peer, checks it against the peer's limits, registers it (with its
// deadline) and sends it on the connection; on_reply() completes it from the reply; a cancel (the caller's future),
// the deadline timer or the connection's loss complete it without one. Every step that can fail comes before the
// call is registered and counted: a failure there concerns that call alone, and start() throws it to its caller.
// Threads: start() and cancel() on any thread; on_reply(), the deadline timer and closed() on the connection's I/O
// thread. The tables guard themselves (pending_calls.hpp, inbound_calls.hpp).
#pragma once

#include <asio.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "corpc/core/call_context.hpp"
#include "corpc/rpc/detail/outbound.hpp"

#include "rpc/activity.hpp"
#include "rpc/inbound_calls.hpp"
#include "rpc/pending_calls.hpp"
#include "rpc/rpc_session.hpp"
#include "transport/connection.hpp"
#include "transport/frames.hpp"

namespace corpc::detail {

// The CallContext slot that marks work whose calls max_calls_in_flight_per_peer does not hold back (1): a handler
// serving a request (its calls are nested in that request) and the runtime's own bookkeeping (RRef control messages,
// context releases, started by spawn_background). The bound is for the program's own calls: a nested call that
// waited for room could wait on the very requests whose handlers wait on it, and bookkeeping started on a handler's
// thread would block that thread for room (docs/flow-control.md).
inline int call_bound_exempt_slot() {
  static const int slot = CallContext::new_slot();
  return slot;
}
inline bool call_bound_exempt() noexcept { return current_call_context().get(call_bound_exempt_slot()) == 1; }

// What a call engine uses of the runtime it serves; one per runtime, outliving every connection. Tests give it one
// of their own.
class CallHost {
 public:
  virtual ~CallHost() = default;
  // Worker `rank`'s name, for errors.
  virtual std::string name_of(int rank) const = 0;
  // `m` as a frame for `rank` on `conn`, with distributed autograd's ids stamped. Throws what prepare() throws.
  virtual OutFrame frame_for(Message&& m, int rank, Connection& conn) = 0;
  // Hands a reply's tensors to distributed autograd (throws what it throws).
  virtual void received_tensors(const FrameHeader& h, int src, std::vector<at::Tensor>& tensors) = 0;
  // Arms `slot` (the caller's future) so that cancelling it cancels call `id` on `conn`, for as long as `conn` is
  // the connection that carries our calls to `conn.peer_rank`.
  virtual void arm_cancel(CancelSlot& slot, Connection& conn, std::uint64_t id) = 0;
  // The counts graceful shutdown waits on.
  virtual Activity& activity() = 0;
  // A call's timeout when it sets none (RpcOptions::rpc_timeout).
  virtual std::chrono::milliseconds default_timeout() const = 0;
};

class CallEngine final : public RpcSession {
 public:
  // `max_in_flight`: RpcOptions::max_calls_in_flight_per_peer; `dialed`: the connection is ours (RpcSession::outgoing).
  CallEngine(asio::io_context& io, CallHost& host, std::size_t max_in_flight, bool dialed);

  static CallEngine& of(Connection& conn) noexcept { return static_cast<CallEngine&>(*conn.session()); }
  // The session factory of the runtime's connections (ConnectionSettings::make_session), dialed or accepted.
  static SessionFactory factory(CallHost& host, std::size_t max_in_flight, bool dialed);

  // Sends `call` on `conn` (whose engine this is). Throws, having touched nothing, if it cannot be framed or is over
  // the peer's limits; from then on every outcome reaches call.complete.
  void start(const std::shared_ptr<Connection>& conn, OutboundCall&& call);
  // A Response or Error frame on `conn`: completes its call.
  void on_reply(const std::shared_ptr<Connection>& conn, Message&& msg);
  // Completes call `id` (if still pending) as cancelled and tells the callee. Any thread.
  void cancel(const std::shared_ptr<Connection>& conn, std::uint64_t id);
  // Fails call `id` (if still pending: returns whether it was) with `error` and no reply: staging its request's
  // tensors failed, the delivery of its reply to a device did, or it was cancelled.
  bool fail_call(const std::shared_ptr<Connection>& conn, std::uint64_t id, std::exception_ptr error);
  // The connection is gone: fails our calls with `error`, refuses later ones, and stops the peer's requests here.
  void closed(std::exception_ptr error);

  // The peer's requests running here (the request side registers and removes them; a cancel frame stops one).
  InboundCalls& inbound() noexcept { return inbound_; }

 private:
  void send(const std::shared_ptr<Connection>& conn, OutFrame&& frame, bool counted);
  void send_all(const std::shared_ptr<Connection>& conn, std::vector<OutFrame>& ready);
  void finish_without_reply(PendingCall& p, std::exception_ptr error) noexcept;
  void send_cancel(Connection& conn, std::uint64_t id) noexcept;
  void arm_deadline_timer(const std::shared_ptr<Connection>& conn);  // the I/O thread
  std::exception_ptr timed_out(const PendingCall& p) const;
  std::string timed_out_text(std::string_view function, int dst, std::chrono::milliseconds timeout, bool unsent) const;
  std::chrono::milliseconds effective_timeout(std::optional<std::chrono::milliseconds> asked) const;

  CallHost& host_;
  std::size_t max_in_flight_;
  // On a cache line of its own: the caller's thread and the I/O thread both write it (its lock) on every call, and
  // the fields above are read on every call (measured: 0.3 µs more per call at 64 in flight when they shared one).
  alignas(64) PendingCalls pending_;
  asio::steady_timer deadline_timer_;                                         // I/O thread
  std::atomic<Clock::time_point> timer_armed_for_{Clock::time_point::max()};  // written on the I/O thread
  InboundCalls inbound_;
};

// Runs `send(frame)` on `conn`'s I/O thread once the frame's CUDA tensors are staged (now if it has none), or
// `failed(error)` there if staging failed. Both directions use it: requests and replies.
void when_staged(const std::shared_ptr<Connection>& conn, OutFrame&& frame, std::function<void(OutFrame&&)> send,
                 std::function<void(std::exception_ptr)> failed);

}  // namespace corpc::detail
