#include "transport/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "corpc/transport/errors.hpp"
#include "corpc/wire/errors.hpp"

namespace corpc::detail {

namespace {

constexpr char kTag[4] = {'C', 'R', 'P', 'A'};
using Nonce = std::array<unsigned char, 16>;
using Mac = std::array<unsigned char, 32>;

Nonce fresh_nonce() {
  Nonce n;
  if (RAND_bytes(n.data(), static_cast<int>(n.size())) != 1) throw ConnectionError("authentication: no randomness");
  return n;
}

// `binding`: the TLS session's exported keying material, or empty without TLS.
Mac mac(const std::string& secret, const char* label, const Nonce& first, const Nonce& second,
        const std::string& binding) {
  std::string msg(label);
  msg.append(reinterpret_cast<const char*>(first.data()), first.size());
  msg.append(reinterpret_cast<const char*>(second.data()), second.size());
  msg += binding;
  Mac out;
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len) ||
      len != out.size())
    throw ConnectionError("authentication: HMAC failed");
  return out;
}

bool same(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

}  // namespace

asio::awaitable<void> authenticate(Transport& socket, const AuthConfig& config, AuthRole role) {
  if (config.secret.empty() && !config.tls) co_return;
  // A peer that stops talking is dropped: the timer closes the socket, which aborts the pending read.
  asio::steady_timer timer(socket.get_executor(), config.timeout);
  const auto started = std::chrono::steady_clock::now();
  bool timed_out = false;
  // The timer's handler may already be queued when the handshake ends (the peer gave up at the same moment): it must
  // then touch nothing of this frame or of `socket`, which may be gone by the time it runs.
  auto running = std::make_shared<bool>(true);
  timer.async_wait([&, running](const asio::error_code& ec) {
    if (ec || !*running) return;
    timed_out = true;
    asio::error_code ignored;
    socket.socket().close(ignored);
  });
  bool tls_up = false;
  try {
    if (config.tls) co_await socket.start_tls(*config.tls, role);
    tls_up = true;
    const std::string binding = socket.channel_binding();
    if (config.secret.empty()) {
      // TLS alone: the certificates authenticate the peers.
    } else if (role == AuthRole::acceptor) {
      const Nonce mine = fresh_nonce();
      std::array<char, 4 + 16> hello;
      std::memcpy(hello.data(), kTag, 4);
      std::memcpy(hello.data() + 4, mine.data(), 16);
      co_await asio::async_write(socket, asio::buffer(hello), asio::use_awaitable);
      std::array<unsigned char, 4 + 16 + 32> proof;
      co_await asio::async_read(socket, asio::buffer(proof), asio::use_awaitable);
      if (std::memcmp(proof.data(), kTag, 4) != 0) {
        // 0x16 0x03: a TLS ClientHello.
        throw ConnectionError(proof[0] == 0x16 && proof[1] == 0x03
                                  ? "the peer speaks TLS and this worker does not (is RpcOptions::tls / CORPC_TLS_CERT "
                                    "set on every rank?)"
                                  : "not a corpc peer (no authentication)");
      }
      Nonce theirs;
      Mac got;
      std::memcpy(theirs.data(), proof.data() + 4, 16);
      std::memcpy(got.data(), proof.data() + 20, 32);
      if (!same(got, mac(config.secret, "dialer", mine, theirs, binding))) throw ConnectionError("wrong secret");
      const Mac answer = mac(config.secret, "acceptor", theirs, mine, binding);
      co_await asio::async_write(socket, asio::buffer(answer), asio::use_awaitable);
    } else {
      std::array<unsigned char, 4 + 16> hello;
      co_await asio::async_read(socket, asio::buffer(hello), asio::use_awaitable);
      if (std::memcmp(hello.data(), kTag, 4) != 0)
        throw ConnectionError("the peer does not authenticate (is CORPC_SECRET set on every rank?)");
      Nonce theirs;
      std::memcpy(theirs.data(), hello.data() + 4, 16);
      const Nonce mine = fresh_nonce();
      const Mac proof = mac(config.secret, "dialer", theirs, mine, binding);
      std::array<unsigned char, 4 + 16 + 32> out;
      std::memcpy(out.data(), kTag, 4);
      std::memcpy(out.data() + 4, mine.data(), 16);
      std::memcpy(out.data() + 20, proof.data(), 32);
      co_await asio::async_write(socket, asio::buffer(out), asio::use_awaitable);
      Mac answer;
      co_await asio::async_read(socket, asio::buffer(answer), asio::use_awaitable);
      if (!same(answer, mac(config.secret, "acceptor", mine, theirs, binding)))
        throw ConnectionError("the peer does not know the secret");
    }
  } catch (const std::exception& e) {
    *running = false;
    timer.cancel();
    if (dynamic_cast<const ConnectionError*>(&e) && !timed_out) throw;
    // A plain dialer and a TLS acceptor both wait (the one for the challenge, the other for a ClientHello) until
    // one side's timeout; a TLS dialer meeting a plain acceptor fails its handshake. A connection the peer closed
    // at once is neither: a peer that left (or crashed) must not read as a TLS mismatch. The acceptor's timeout is
    // its own setting, so "waited" is anything past a quarter second.
    const bool closed = !timed_out && dynamic_cast<const asio::system_error*>(&e) &&
                        static_cast<const asio::system_error&>(e).code() == asio::error::eof;
    const bool waited = std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(250);
    const char* hint = config.tls && !tls_up ? " (does the peer use TLS?)"
                       : !config.tls && role == AuthRole::dialer && (timed_out || (closed && waited))
                           ? " (does the peer expect TLS?)"
                           : "";
    throw ConnectionError((timed_out ? std::string("authentication timed out")
                           : closed  ? std::string("the peer closed the connection during authentication")
                                     : std::string("authentication: ") + e.what()) +
                          hint);
  }
  *running = false;
  timer.cancel();
}

void initialize_openssl() { OPENSSL_init_ssl(0, nullptr); }

std::string random_secret() {
  std::array<unsigned char, 32> bytes;
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1) throw RpcError("no randomness for a secret");
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned char b : bytes) {
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

}  // namespace corpc::detail
