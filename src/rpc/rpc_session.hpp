// What the runtime keeps per connection (its session: transport/connection.hpp's ConnectionSession), beside the calls
// the connection's call engine keeps (call_engine.hpp, which is this session). The transport never looks inside.
#pragma once

#include "transport/connection.hpp"

namespace corpc::detail {

class RpcSession : public ConnectionSession {
 public:
  explicit RpcSession(bool dialed) noexcept : outgoing(dialed) {}
  // The session of one of the runtime's connections (every one has one).
  static RpcSession& of(Connection& conn) noexcept { return static_cast<RpcSession&>(*conn.session()); }

  // We dialed it: our requests to its peer go here, and only replies are accepted on it. Fixed before any frame.
  const bool outgoing;
  // The peer announced an orderly close (a Goodbye came; the frame dispatcher records it). I/O thread.
  bool said_goodbye = false;
  // Its Hello, or its answer to ours, was refused: nothing more it sends is acted on. I/O thread.
  bool hello_refused = false;
};

}  // namespace corpc::detail
