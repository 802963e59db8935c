// The request side: the peers' requests, looked up by function id and run where their function says (on the I/O
// thread that read them, or on the worker pool). Every request ends in exactly one reply or error frame, and in
// exactly one count for graceful shutdown. Cancellation: a handler that may outlive the frame's dispatch (on the
// pool, or a coroutine) runs with a stop token registered in its connection's call engine (CallEngine::inbound),
// which a cancel frame or the connection's loss stops; a request stopped before it started is answered with
// CancelledError without running.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <stop_token>
#include <string_view>

#include "corpc/core/call_context.hpp"
#include "corpc/rpc/runtime.hpp"
#include "rpc/frame_dispatcher.hpp"
#include "rpc/pending_calls.hpp"

namespace corpc::detail {

class RequestServer {
 public:
  // `runtime`: the registry, the worker pool, the counts and the world gate it serves requests with.
  explicit RequestServer(Runtime::Impl& runtime);

  // Registers its routes: request, cancel, oversized.
  void route(FrameDispatcher& frames);

  // The CallContext a request's reply is stamped in: the caller's autograd context id.
  CallContext handler_context(std::int64_t context_id) const noexcept;
  // The one a request's handler runs with: the same, with its stop token and deadline, and marked so that the calls
  // it makes are not held back by max_calls_in_flight_per_peer (call_bound_exempt_slot).
  CallContext handler_context(std::int64_t context_id, std::stop_token stop, Clock::time_point deadline) const noexcept;
  // Answers the request `h` names on `conn` with `error` instead of running it, and counts it as handled.
  void refuse(Connection& conn, const FrameHeader& h, std::exception_ptr error, std::string_view function);
  // Answers request `id` on `conn` with `error`. `traced`: a user request's (the trace leaves control rounds out).
  void send_error(Connection& conn, std::uint64_t id, std::exception_ptr error, std::string_view function, bool traced);

  Runtime::Impl& runtime() noexcept { return rt_; }

 private:
  bool admitted(const std::shared_ptr<Connection>& conn, Message& msg);
  void on_request(const std::shared_ptr<Connection>& conn, Message&& msg);
  void on_cancel(const std::shared_ptr<Connection>& conn, Message&& msg);
  // A request whose header announced more than the receive budget: its bytes were dropped; answer it.
  void refuse_too_large(const std::shared_ptr<Connection>& conn, const FrameHeader& h);

  Runtime::Impl& rt_;
};

}  // namespace corpc::detail
