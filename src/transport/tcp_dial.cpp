// Opening a connection to a peer: to its abstract Unix socket when it is on this host and has one, else over TCP
// (resolve, connect); then authenticate (TLS and the secret), then read. The first frame (the Hello) is made once the
// handshake's transcript is known, and goes out behind the handshake's last message, in one write with it; frames
// sent meanwhile are held until the peer's answer has proved who it is (release_sends). A handshake that
// stalls or breaks off (HandshakeInterrupted: a peer too busy to answer within the timeout, or one that gave up on us
// for the same reason) is tried again on a fresh socket, up to kDialAttempts in all: nothing of the session has been
// sent yet, so the staged frames simply wait longer. A refusal (wrong secret, TLS mismatch) or a refused TCP connect
// fails at once.
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

#include "transport/tcp_connection.hpp"

namespace corpc::detail {

void TcpConnection::dial(std::string host, std::uint16_t port, std::string local_socket, AuthConfig auth,
                         FirstFrame first) {
  asio::co_spawn(socket_.get_executor(),
                 connect(self(), std::move(host), port, std::move(local_socket), std::move(auth), std::move(first)),
                 asio::detached);
}

namespace {
constexpr int kDialAttempts = 3;

// Connects `socket` to the abstract Unix socket `name`, if there is one in this network namespace with room in its
// backlog; false otherwise (the caller then dials TCP). A Unix stream connects at once or not at all, so nothing waits.
// The socket object stays an ip::tcp::socket: Asio needs only a stream descriptor for the reads, writes and waits a
// connection makes, and the TCP-only options it sets on it fail harmlessly.
bool connect_local(asio::ip::tcp::socket& socket, const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.empty() || name.size() + 1 > sizeof addr.sun_path) return false;
  std::memcpy(addr.sun_path + 1, name.data(), name.size());  // sun_path[0] == 0: the abstract namespace
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  const auto length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  asio::error_code ec;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), length) == 0) socket.assign(asio::ip::tcp::v4(), fd, ec);
  else ec = asio::error::connection_refused;
  if (ec) ::close(fd);
  return !ec;
}
}  // namespace

asio::awaitable<void> TcpConnection::connect(std::shared_ptr<TcpConnection> self, std::string host, std::uint16_t port,
                                             std::string local_socket, AuthConfig auth, FirstFrame first) {
  for (int attempt = 1;; ++attempt) {
    std::string failure;
    try {
      // Peers publish numeric addresses: those skip the resolver, whose every lookup is a hop to its own thread and
      // back (a rank dialing a hundred peers pays it a hundred times).
      asio::error_code not_numeric;
      const auto address = asio::ip::make_address(host, not_numeric);
      if (connect_local(self->socket_, local_socket)) {
        self->remote_address = host;
      } else if (!not_numeric) {
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
      self->install_seals();
      self->stage_first(proof);
      // The first frame is made now, for this connection's transcript, and goes out ahead of whatever was held.
      if (first) self->send_frame(first(self->transport_.session_keys().transcript), true);
      else self->release_sends();
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
                                                std::uint16_t port, std::string local_socket,
                                                const ConnectionSettings& settings, FrameHandler on_frame,
                                                CloseHandler on_close, AuthConfig auth, FirstFrame first) {
  auto c = std::make_shared<TcpConnection>(Transport(asio::ip::tcp::socket(io)), settings, std::move(on_frame),
                                           std::move(on_close));
  c->peer_rank = peer_rank;
  c->hold_sends();  // nothing is sealed or written before the handshake is done (connect)
  c->dial(std::move(host), port, std::move(local_socket), std::move(auth), std::move(first));
  return c;
}

}  // namespace corpc::detail
