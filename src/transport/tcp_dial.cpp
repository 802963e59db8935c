// Opening a TCP connection to a peer: resolve, connect, authenticate (TLS and the secret), then read. Frames sent
// meanwhile are staged, and go out behind the handshake's last message, in one write with it, once start_reading()
// flushes them. A handshake that stalls or breaks off (HandshakeInterrupted: a peer too busy to answer within the
// timeout, or one that gave up on us for the same reason) is tried again on a fresh socket, up to kDialAttempts in
// all: nothing of the session has been sent yet, so the staged frames simply wait longer. A refusal (wrong secret,
// TLS mismatch) or a refused connect fails at once.
#include "transport/tcp_connection.hpp"

namespace corpc::detail {

void TcpConnection::dial(std::string host, std::uint16_t port, AuthConfig auth) {
  asio::co_spawn(socket_.get_executor(), connect(self(), std::move(host), port, std::move(auth)), asio::detached);
}

namespace {
constexpr int kDialAttempts = 3;
}

asio::awaitable<void> TcpConnection::connect(std::shared_ptr<TcpConnection> self, std::string host, std::uint16_t port,
                                             AuthConfig auth) {
  for (int attempt = 1;; ++attempt) {
    std::string failure;
    try {
      // Peers publish numeric addresses: those skip the resolver, whose every lookup is a hop to its own thread and
      // back (a rank dialing a hundred peers pays it a hundred times).
      asio::error_code not_numeric;
      const auto address = asio::ip::make_address(host, not_numeric);
      if (!not_numeric) {
        co_await self->socket_.async_connect({address, port}, asio::use_awaitable);
        self->remote_address = address.to_string();
      } else {
        asio::ip::tcp::resolver resolver(self->socket_.get_executor());
        auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), asio::use_awaitable);
        const auto connected = co_await asio::async_connect(self->socket_, endpoints, asio::use_awaitable);
        self->remote_address = connected.address().to_string();
      }
      // Queued frames wait for it; its last message leaves with them.
      std::string proof;
      co_await authenticate(self->transport_, auth, AuthRole::dialer, &proof);
      self->stage_first(proof);
      break;
    } catch (const HandshakeInterrupted& e) {
      // fail() runs on this thread: closed_ cannot change under us here.
      if (attempt < kDialAttempts && !self->closed_) {
        self->transport_.reset();
        continue;
      }
      failure = e.what();
      if (attempt > 1) failure += " (" + std::to_string(attempt) + " attempts)";
    } catch (const std::exception& e) {
      failure = e.what();
    }
    self->fail("cannot connect to " + host + ":" + std::to_string(port) + ": " + failure);
    co_return;
  }
  if (!self->closed_) self->start_reading();
}

std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, const ConnectionSettings& settings,
                                                FrameHandler on_frame, CloseHandler on_close, AuthConfig auth) {
  auto c = std::make_shared<TcpConnection>(Transport(asio::ip::tcp::socket(io)), settings, std::move(on_frame),
                                           std::move(on_close));
  c->peer_rank = peer_rank;
  c->outgoing = true;
  c->dial(std::move(host), port, std::move(auth));
  return c;
}

}  // namespace corpc::detail
