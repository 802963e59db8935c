// Liveness of a TCP connection: heartbeats while it is quiet, and the silence after which its peer is unreachable.
#include "transport/tcp_connection.hpp"

namespace corpc::detail {

void TcpConnection::send_heartbeat(FrameKind kind) {
  OutFrame f;
  f.head.kind = kind;
  send(std::move(f));
}

// Liveness: every quarter of the timeout, a connection that heard nothing (no bytes in, no progress writing out)
// since the last check sends a Ping; after four such checks in a row the peer is declared unreachable. A busy
// connection sends nothing extra; an idle one a 72-byte Ping and Pong per quarter. TCP keepalive would not do:
// the kernel of a stopped process still answers it.
void TcpConnection::schedule_liveness_check() {
  liveness_timer_.expires_after(settings_.liveness_timeout / kLivenessChecks);
  liveness_timer_.async_wait([self = self()](const asio::error_code& ec) {
    if (!ec && !self->closed_) self->check_liveness();
  });
}
void TcpConnection::check_liveness() {
  // While we do not read (paused for room) we cannot hear the peer: that is our doing, not its silence.
  const bool heard = heard_ != heard_checked_ || written_ != written_checked_ || paused_;
  heard_checked_ = heard_;
  written_checked_ = written_;
  if (heard) {
    silent_checks_ = 0;
  } else if (++silent_checks_ >= kLivenessChecks) {
    return fail("unreachable: no sign of life for " + std::to_string(settings_.liveness_timeout.count()) +
                " ms (heartbeats unanswered: the process may be stopped or the network cut)");
  }
  // A paused reader pings too, so that the peer keeps hearing from us while we do not read it.
  if (silent_checks_ > 0 || paused_) send_heartbeat(FrameKind::Ping);
  schedule_liveness_check();
}

}  // namespace corpc::detail
