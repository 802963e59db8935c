// The RPC layer's state on one connection: our calls awaiting replies on it, the timer armed for the earliest of
// their deadlines, and the peer's calls running here that a cancel frame can still stop. Kept as the connection's
// session (transport/connection.hpp), so it lives exactly as long as the connection.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <memory>

#include "rpc/inbound_calls.hpp"
#include "rpc/pending_calls.hpp"
#include "transport/connection.hpp"

namespace corpc::detail {

struct ConnectionCalls final : ConnectionSession {
  explicit ConnectionCalls(asio::io_context& io) : deadline_timer(io) {}

  static std::unique_ptr<ConnectionSession> make(asio::io_context& io) { return std::make_unique<ConnectionCalls>(io); }

  PendingCalls pending;
  asio::steady_timer deadline_timer;                                         // I/O thread
  std::atomic<Clock::time_point> timer_armed_for{Clock::time_point::max()};  // written on the I/O thread
  InboundCalls inbound;
};

// Every connection the runtime makes carries one (Runtime::Impl::connection_settings).
inline ConnectionCalls& calls_on(Connection& conn) noexcept { return static_cast<ConnectionCalls&>(*conn.session()); }

}  // namespace corpc::detail
