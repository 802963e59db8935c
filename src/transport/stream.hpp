// The byte stream under a TCP connection: the socket, and optionally a TLS session over it (RpcOptions::tls).
// Private to the runtime.
//
// A Transport is an Asio AsyncReadStream/AsyncWriteStream, so the connection's reads (asio::async_read and friends)
// are the same code with or without TLS. Its state lives on the heap: the TLS session refers to the socket, and the
// Transport moves from the acceptor's handshake into the connection that serves it.
#pragma once

#include <asio.hpp>
#include <asio/ssl.hpp>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <utility>

namespace corpc {
struct TlsOptions;
}

namespace corpc::detail {

enum class AuthRole { acceptor, dialer };

// What a connection's handshake (auth.hpp) established, for what is bound to it afterwards.
struct SessionKeys {
  // The bytes both ends saw and no other connection shares: the two nonces and the TLS binding (empty when nothing
  // was exchanged: no secret and no TLS). The rendezvous Hellos sign it, so a Hello proves nothing on another
  // connection.
  std::string transcript;
  // The keys that authenticate every frame this end sends and receives (frame_seal.hpp), derived from the secret and
  // the transcript; empty when frames are not sealed (no secret, or TLS, whose records carry their own integrity).
  std::string send_key;
  std::string receive_key;
};

// The TLS settings every connection of a runtime shares: TLS 1.3 only, our certificate and key, the CA that peers'
// certificates must chain to. Throws UsageError naming the file and OpenSSL's reason when one cannot be used.
std::shared_ptr<asio::ssl::context> make_tls_context(const TlsOptions& options);

class Transport {
 public:
  using executor_type = asio::ip::tcp::socket::executor_type;

  explicit Transport(asio::ip::tcp::socket socket) : s_(std::make_unique<State>(std::move(socket))) {}

  asio::ip::tcp::socket& socket() noexcept { return s_->socket; }
  executor_type get_executor() noexcept { return s_->socket.get_executor(); }
  // Whether reads and writes go through TLS (after start_tls). Encrypted output is written by the connection's I/O
  // thread only: the direct sendmsg from the sending thread is for plain TCP.
  bool encrypted() const noexcept { return s_->tls.has_value(); }

  // The TLS handshake as `role` (dialer: TLS client); from then on every byte is encrypted. Throws ConnectionError
  // with the reason (the certificate check's verdict, or a hint when the peer does not speak TLS).
  asio::awaitable<void> start_tls(asio::ssl::context& context, AuthRole role);

  // Closes the socket and forgets any TLS session, so that the same socket object can connect again (a redial after
  // an interrupted handshake). Only before the connection is handed to readers and writers.
  void reset() noexcept {
    s_->tls.reset();
    s_->keys = {};
    asio::error_code ignored;
    s_->socket.close(ignored);
  }

  // 32 bytes that only the two ends of this TLS session know (RFC 5705 keying material exporter), so that a
  // challenge-response mixed with them cannot be relayed into another session; empty without TLS.
  std::string channel_binding();

  // What the handshake established (set by authenticate; empty before, or without one).
  const SessionKeys& session_keys() const noexcept { return s_->keys; }
  void set_session_keys(SessionKeys keys) { s_->keys = std::move(keys); }

  template <class MutableBuffers, class Token>
  auto async_read_some(const MutableBuffers& buffers, Token&& token) {
    if (s_->tls) return s_->tls->async_read_some(buffers, std::forward<Token>(token));
    return s_->socket.async_read_some(buffers, std::forward<Token>(token));
  }
  template <class ConstBuffers, class Token>
  auto async_write_some(const ConstBuffers& buffers, Token&& token) {
    if (s_->tls) return s_->tls->async_write_some(buffers, std::forward<Token>(token));
    return s_->socket.async_write_some(buffers, std::forward<Token>(token));
  }

 private:
  struct State {
    explicit State(asio::ip::tcp::socket s) : socket(std::move(s)) {}
    asio::ip::tcp::socket socket;
    std::optional<asio::ssl::stream<asio::ip::tcp::socket&>> tls;
    SessionKeys keys;
  };
  std::unique_ptr<State> s_;
};

}  // namespace corpc::detail
