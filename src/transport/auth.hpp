// Connection authentication: a challenge–response over a shared secret, run on every TCP connection before any
// frame is read from it (internal).
//
//   dialer -> acceptor:  "CRPA" nonce_d (16 random bytes)
//   acceptor -> dialer:  "CRPA" nonce_a  HMAC-SHA256(secret, "acceptor" || nonce_d || nonce_a)
//   dialer -> acceptor:                  HMAC-SHA256(secret, "dialer"   || nonce_a || nonce_d)
//
// Both sides prove knowledge of the secret over nonces the other chose, so neither a replay nor a reflection passes
// (the labels keep one side's proof from serving as the other's). The dialer speaks first so that its proof can leave
// in one write with its first frames: a connection costs three messages before the peer reads a request, not four.
// The acceptor proves itself first, and the dialer checks that proof before it sends anything else.
// With TLS (RpcOptions::tls) the TLS handshake comes first, the exchange runs inside it, and both MACs also cover
// the session's exported keying material: a relay that terminates TLS on each side cannot pass it on.
// What it leaves on the transport (stream.hpp's SessionKeys): the transcript (both nonces and the TLS binding), which
// the rendezvous Hellos sign so that they prove nothing on another connection; and, with a secret and without TLS,
// a key per direction derived from the secret over the transcript, which seals every frame (frame_seal.hpp): a relay
// that passes the exchange on between the real ends, as it can, still cannot change what follows.
// Nothing identifying (names, ranks, world size) is sent before this succeeds. With an empty secret nothing is
// exchanged: the job is open to any process that can reach its ports (the runtime says so at start-up).
#pragma once

#include <asio.hpp>

#include <chrono>
#include <memory>
#include <string>

#include "corpc/transport/errors.hpp"

#include "transport/stream.hpp"

namespace corpc::detail {

struct AuthConfig {
  std::string secret;                       // empty: no authentication
  std::chrono::milliseconds timeout{5000};  // the whole handshake; a silent peer is dropped after it
  std::shared_ptr<asio::ssl::context> tls;  // null: plain TCP
  // With a secret and without TLS: derive keys that seal every frame (frame_seal.hpp). Both ends must agree: it is
  // part of what each side proves, so a mismatch fails the handshake.
  bool seal_frames = true;
};

// What authenticate throws when the handshake stalled or broke off rather than being refused: the peer did not answer
// within the timeout, or closed or reset the connection before the end. An overloaded peer (hundreds of handshakes
// queued behind its turn on a CPU) looks like this, so a dialer may try again on a fresh connection.
class HandshakeInterrupted : public ConnectionError {
 public:
  using ConnectionError::ConnectionError;
};

// Secures `transport` as `role`: the TLS handshake (if configured), then the challenge-response (if there is a
// secret). Throws ConnectionError (the reason, naming no worker) on failure or timeout. A dialer that passes
// `last_message` gets its closing proof there instead of on the socket, to send ahead of its first frames in the same
// write (the acceptor reads no frame before it); left empty when there is nothing to send.
asio::awaitable<void> authenticate(Transport& transport, const AuthConfig& config, AuthRole role,
                                   std::string* last_message = nullptr);

// A fresh random secret (hex), for launchers that start all the ranks of a job.
std::string random_secret();

// Initializes OpenSSL now, so that its exit-time cleanup is registered before what the caller registers next: exit
// handlers run in reverse order, and a runtime shut down at exit still authenticates connections.
void initialize_openssl();

}  // namespace corpc::detail
