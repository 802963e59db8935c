#include "transport/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/ssl.h>

#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "corpc/transport/errors.hpp"
#include "corpc/wire/errors.hpp"

#include "transport/mac.hpp"

namespace corpc::detail {

namespace {

constexpr char kTag[4] = {'C', 'R', 'P', 'A'};
using Nonce = std::array<unsigned char, 16>;
using Mac = Sha256Mac;

Nonce fresh_nonce() {
  Nonce n;
  if (!random_bytes(n.data(), n.size())) throw ConnectionError("authentication: no randomness");
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
  if (!hmac_sha256_into(secret, msg, out)) throw ConnectionError("authentication: HMAC failed");
  return out;
}

bool same(const Mac& a, const Mac& b) { return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0; }

std::string bytes_of(const Nonce& n) { return std::string(reinterpret_cast<const char*>(n.data()), n.size()); }

// What the exchange leaves on the transport: the transcript (the dialer's nonce, the acceptor's, the TLS binding) and,
// without TLS, a key per direction for sealing frames, derived from the secret over the transcript: only the two ends
// know the secret, and no other connection has the same nonces.
// `seal`: with a secret, without TLS, as both ends agreed.
SessionKeys session_keys(const std::string& secret, const Nonce& dialer, const Nonce& acceptor,
                         const std::string& binding, bool seal, AuthRole role) {
  SessionKeys keys;
  keys.transcript = bytes_of(dialer) + bytes_of(acceptor) + binding;
  if (seal) {
    auto derive = [&](const char* label) {
      const Mac m = mac(secret, label, dialer, acceptor, binding);
      return std::string(reinterpret_cast<const char*>(m.data()), m.size());
    };
    std::string from_dialer = derive("corpc frames from the dialer");
    std::string from_acceptor = derive("corpc frames from the acceptor");
    const bool dialing = role == AuthRole::dialer;
    keys.send_key = dialing ? from_dialer : from_acceptor;
    keys.receive_key = dialing ? from_acceptor : from_dialer;
  }
  return keys;
}

// g++ 16 at -O1 inlines the coroutine frames' class-specific operator delete (Asio's awaitable_frame_base, which
// recycles frames) and reports it as mismatched with the same class's operator new: a false positive, silenced for
// these coroutines only.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

// What each side's proof covers besides the nonces: its role and whether frames are sealed (ends that disagree on
// sealing fail the handshake, not a frame).
struct ProofLabels {
  const char* acceptor;
  const char* dialer;
};

// The acceptor's side: reads the dialer's challenge, answers with its nonce and proof, checks the dialer's proof.
asio::awaitable<void> answer_challenge(Transport& socket, const std::string& secret, const ProofLabels& labels,
                                       const std::string& binding, bool sealing) {
  std::array<unsigned char, 4 + 16> challenge;
  co_await asio::async_read(socket, asio::buffer(challenge), asio::use_awaitable);
  if (std::memcmp(challenge.data(), kTag, 4) != 0) {
    // 0x16 0x03: a TLS ClientHello.
    throw ConnectionError(challenge[0] == 0x16 && challenge[1] == 0x03
                              ? "the peer speaks TLS and this worker does not (is RpcOptions::tls / CORPC_TLS_CERT "
                                "set on every rank?)"
                              : "not a corpc peer (no authentication)");
  }
  Nonce theirs;
  std::memcpy(theirs.data(), challenge.data() + 4, 16);
  const Nonce mine = fresh_nonce();
  const Mac proof = mac(secret, labels.acceptor, theirs, mine, binding);
  std::array<unsigned char, 4 + 16 + 32> out;
  std::memcpy(out.data(), kTag, 4);
  std::memcpy(out.data() + 4, mine.data(), 16);
  std::memcpy(out.data() + 20, proof.data(), 32);
  co_await asio::async_write(socket, asio::buffer(out), asio::use_awaitable);
  Mac got;
  co_await asio::async_read(socket, asio::buffer(got), asio::use_awaitable);
  if (!same(got, mac(secret, labels.dialer, mine, theirs, binding))) throw ConnectionError("wrong secret");
  socket.set_session_keys(session_keys(secret, theirs, mine, binding, sealing, AuthRole::acceptor));
}

// The dialer's side: sends its challenge, checks the acceptor's proof, proves itself (or leaves its proof in
// `last_message`, for the caller to send with its first frame).
asio::awaitable<void> challenge_acceptor(Transport& socket, const std::string& secret, const ProofLabels& labels,
                                         const std::string& binding, bool sealing, std::string* last_message) {
  const Nonce mine = fresh_nonce();
  std::array<unsigned char, 4 + 16> challenge;
  std::memcpy(challenge.data(), kTag, 4);
  std::memcpy(challenge.data() + 4, mine.data(), 16);
  co_await asio::async_write(socket, asio::buffer(challenge), asio::use_awaitable);
  std::array<unsigned char, 4 + 16 + 32> answer;
  // Read with the error in hand: what arrived before a close says who the peer is (a TLS alert, a stranger).
  asio::error_code ec;
  const std::size_t n =
      co_await asio::async_read(socket, asio::buffer(answer), asio::redirect_error(asio::use_awaitable, ec));
  if (n >= 4 && std::memcmp(answer.data(), kTag, 4) != 0) {
    // 0x15 0x03: a TLS alert, the TLS acceptor's answer to a plain challenge.
    throw ConnectionError(answer[0] == 0x15 && answer[1] == 0x03
                              ? "the peer answered with a TLS alert (does the peer expect TLS? is RpcOptions::tls "
                                "/ CORPC_TLS_CERT set on every rank?)"
                              : "the peer does not authenticate (is CORPC_SECRET set on every rank?)");
  }
  if (ec) throw asio::system_error(ec);
  Nonce theirs;
  Mac got;
  std::memcpy(theirs.data(), answer.data() + 4, 16);
  std::memcpy(got.data(), answer.data() + 20, 32);
  if (!same(got, mac(secret, labels.acceptor, mine, theirs, binding))) {
    // A proof that cannot match, so that the acceptor too learns (and logs) that the secrets differ.
    const Mac refusal{};
    asio::error_code ignored;
    co_await asio::async_write(socket, asio::buffer(refusal), asio::redirect_error(asio::use_awaitable, ignored));
    throw ConnectionError(
        "the peer does not know our secret (is the same CORPC_SECRET set on every rank? and the same "
        "CORPC_SEAL_FRAMES?)");
  }
  const Mac proof = mac(secret, labels.dialer, theirs, mine, binding);
  socket.set_session_keys(session_keys(secret, mine, theirs, binding, sealing, AuthRole::dialer));
  if (last_message) {
    last_message->assign(reinterpret_cast<const char*>(proof.data()), proof.size());
  } else {
    co_await asio::async_write(socket, asio::buffer(proof), asio::use_awaitable);
  }
}

// The error a failed handshake ends with. A TLS dialer meeting a plain acceptor fails its TLS handshake; a plain
// dialer meeting a TLS acceptor reads its alert (above). A connection the peer closed without a word is neither: a
// peer that left (or crashed) must not read as a TLS mismatch, and is HandshakeInterrupted, as a timeout is.
[[noreturn]] void throw_handshake_failure(const std::exception& e, bool timed_out, bool tls_not_up) {
  if (dynamic_cast<const ConnectionError*>(&e) && !timed_out) throw;
  const auto* system = dynamic_cast<const asio::system_error*>(&e);
  const bool closed = !timed_out && system && system->code() == asio::error::eof;
  const bool reset = !timed_out && system && system->code() == asio::error::connection_reset;
  const char* hint = tls_not_up ? " (does the peer use TLS?)" : "";
  std::string what = (timed_out ? std::string("authentication timed out")
                      : closed  ? std::string("the peer closed the connection during authentication")
                                : std::string("authentication: ") + e.what()) +
                     hint;
  if (timed_out || closed || reset) throw HandshakeInterrupted(std::move(what));
  throw ConnectionError(std::move(what));
}

}  // namespace

asio::awaitable<void> authenticate(Transport& socket, const AuthConfig& config, AuthRole role,
                                   std::string* last_message) {
  if (config.secret.empty() && !config.tls) co_return;
  // A peer that stops talking is dropped: the timer closes the socket, which aborts the pending read.
  asio::steady_timer timer(socket.get_executor(), config.timeout);
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
    const bool sealing = config.seal_frames && !config.tls;
    const ProofLabels labels = sealing ? ProofLabels{"acceptor", "dialer"}
                                       : ProofLabels{"acceptor, frames unsealed", "dialer, frames unsealed"};
    if (config.secret.empty()) {
      // TLS alone: the certificates authenticate the peers, and the session's binding is the transcript.
      socket.set_session_keys(SessionKeys{binding, {}, {}});
    } else if (role == AuthRole::acceptor) {
      co_await answer_challenge(socket, config.secret, labels, binding, sealing);
    } else {
      co_await challenge_acceptor(socket, config.secret, labels, binding, sealing, last_message);
    }
  } catch (const std::exception& e) {
    *running = false;
    timer.cancel();
    throw_handshake_failure(e, timed_out, config.tls && !tls_up);
  }
  *running = false;
  timer.cancel();
}
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic pop
#endif

void initialize_openssl() { OPENSSL_init_ssl(0, nullptr); }

std::string random_secret() {
  std::array<unsigned char, 32> bytes;
  if (!random_bytes(bytes.data(), bytes.size())) throw RpcError("no randomness for a secret");
  return hex(bytes.data(), bytes.size());
}

}  // namespace corpc::detail
