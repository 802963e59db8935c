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
#include <string>
#include <string_view>
#include <vector>

#include "corpc/core/call_context.hpp"
#include "corpc/core/executor.hpp"
#include "corpc/rpc/detail/registry.hpp"

#include "rpc/activity.hpp"
#include "rpc/frame_dispatcher.hpp"
#include "rpc/pending_calls.hpp"

namespace corpc::detail {

// What the request side uses of the runtime it serves; one per runtime, outliving every connection. Tests give it one
// of their own.
class RequestHost {
 public:
  virtual ~RequestHost() = default;
  // This worker's name and worker `rank`'s, for errors.
  virtual const std::string& self_name() const = 0;
  virtual std::string name_of(int rank) const = 0;
  // The function registered with id `function`; nullptr if none. What it returns lives as long as the host.
  virtual const HandlerEntry* function(std::uint64_t function) const = 0;
  // Parks `msg`, which came on `conn`, if the world table is not known yet (or frames before it on `conn` are still
  // parked): it is dispatched again on `conn`'s I/O thread once the table is. True if parked.
  virtual bool park_until_world(const std::shared_ptr<Connection>& conn, Message& msg) = 0;
  // `m` (a reply) as a frame for `rank` on `conn`, with distributed autograd's ids stamped (the call side frames its
  // requests with the same function). Throws what prepare() throws.
  virtual OutFrame frame_for(Message&& m, int rank, Connection& conn) = 0;
  // Hands a request's tensors to distributed autograd (throws what it throws).
  virtual void received_tensors(const FrameHeader& h, int src, std::vector<at::Tensor>& tensors) = 0;
  // The counts graceful shutdown waits on.
  virtual Activity& activity() = 0;
  // Where functions that ask for the worker pool run.
  virtual Executor& pool() = 0;
  // The CallContext slot of distributed autograd's context id (-1: none).
  virtual int autograd_context_slot() const = 0;
  // The largest request this worker may hold (WireLimits::max_request_bytes), for the error that refuses a larger one.
  virtual std::uint64_t max_request_bytes() const = 0;
};

class RequestServer {
 public:
  explicit RequestServer(RequestHost& host);

  // Its frames (route_requests): a Request, a cancel (a Request with kFlagCancel), and a request whose bytes the
  // transport dropped for its size (its header only).
  void on_request(const std::shared_ptr<Connection>& conn, Message&& msg);
  void on_cancel(const std::shared_ptr<Connection>& conn, Message&& msg);
  void refuse_too_large(const std::shared_ptr<Connection>& conn, const FrameHeader& h);

  // The CallContext a request's reply is stamped in: the caller's autograd context id.
  CallContext handler_context(std::int64_t context_id) const noexcept;
  // The one a request's handler runs with: the same, with its stop token and deadline, and marked so that the calls
  // it makes are not held back by max_calls_in_flight_per_peer (call_bound_exempt_slot).
  CallContext handler_context(std::int64_t context_id, std::stop_token stop, Clock::time_point deadline) const noexcept;
  // Answers the request `h` names on `conn` with `error` instead of running it, and counts it as handled.
  void refuse(Connection& conn, const FrameHeader& h, std::exception_ptr error, std::string_view function);
  // Answers request `id` on `conn` with `error`. `traced`: a user request's (the trace leaves control rounds out).
  void send_error(Connection& conn, std::uint64_t id, std::exception_ptr error, std::string_view function, bool traced);

  RequestHost& host() noexcept { return host_; }

 private:
  bool admitted(const std::shared_ptr<Connection>& conn, Message& msg);

  RequestHost& host_;
};

// Makes `server` the owner of the request, cancel and oversized routes.
void route_requests(FrameDispatcher& frames, RequestServer& server);

}  // namespace corpc::detail
