// Which rank a connection speaks for, proven rather than claimed (internal).
//
// The job's secret (auth.hpp) proves that a process belongs to the job; it says nothing of which rank the process is.
// Three things do:
//   - a launcher key K that only the launcher and rank 0 hold (CORPC_RANK_KEY): the launcher deals each start of rank
//     r, its incarnation i, the credential C(r, i) = HMAC-SHA256(K, "corpc rank credential" || r || i)
//     (CORPC_RANK_CREDENTIAL), and rank 0 recomputes it to check a registration;
//   - a key pair of each process's own (Ed25519), made at init_rpc: a registration proves C(r, i) over the connection's
//     handshake and the process's public key, and rank 0 publishes the keys it admitted in the world table;
//   - rank 0's signature over (r, i, public key) for an incarnation admitted after the world was published: the new
//     incarnation shows it to peers, which check it against rank 0's key from the table.
// Both Hellos of a connection, the dialer's and the acceptor's answer, are signed over the rank and incarnation each
// claims, the rank it speaks to and the connection's handshake transcript: a Hello replayed on another connection, or
// an answer from whoever now listens at a dead rank's address, proves nothing. The cost is one signature and one
// verification per connection and side, none per message.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace corpc::detail {

// An Ed25519 key pair: the process's identity for as long as it runs.
class RankKey {
 public:
  static RankKey generate();
  RankKey(RankKey&&) noexcept;
  RankKey& operator=(RankKey&&) noexcept;
  ~RankKey();

  const std::string& public_key() const noexcept { return public_key_; }  // 32 bytes
  std::string sign(std::string_view message) const;                       // 64 bytes

 private:
  struct Impl;
  explicit RankKey(std::unique_ptr<Impl> impl, std::string public_key);
  std::unique_ptr<Impl> impl_;
  std::string public_key_;
};

// Whether `signature` is `public_key`'s over `message` (false for a malformed key or signature).
bool verify_signature(std::string_view public_key, std::string_view message, std::string_view signature);

// A fresh launcher key, hex, for a launcher that starts the ranks of one job.
std::string random_launcher_key();

// The credential the launcher deals to incarnation `incarnation` of `rank` (hex, 64 characters): HMAC-SHA256 under
// the launcher key over credential_message(), hex-encoded.
std::string rank_credential(std::string_view launcher_key, int rank, std::uint32_t incarnation);
// What that credential is a MAC of (nothing secret): for a launcher that computes it where the key lives
// (src/transport/launcher_key.cpp).
std::string credential_message(int rank, std::uint32_t incarnation);

// A registration's proof that its sender holds `credential`, bound to the sender's public key (32 bytes): only rank 0
// sees it, and it vouches for that key alone.
std::string credential_proof(std::string_view credential, std::string_view public_key);
bool credential_proof_matches(std::string_view credential, std::string_view public_key, std::string_view proof);

// What each side of a connection signs in its Hello: the rank and incarnation it claims, the rank it speaks to, and
// the connection's handshake transcript (stream.hpp's SessionKeys), so that a Hello proves nothing on any other
// connection, and the dialer's cannot pass for the acceptor's answer or the other way round.
enum class HelloSide { dialer, acceptor };
std::string hello_statement(HelloSide side, int rank, std::uint32_t incarnation, int to_rank,
                            std::string_view transcript);
// What a dialer presents on the acceptor's Unix socket to claim the same-host channel the acceptor offered with
// `cookie` on the connection whose handshake `transcript` is (shm_channel.hpp): with a secret, HMAC-SHA256 under it
// over the transcript and the cookie, hex (as long as a cookie). The cookie travels in a tagged, not encrypted,
// answer: a process on the path can read it, but only the two ends can turn it into the claim, and the claim is good
// for that connection alone. Without a secret, the cookie.
std::string channel_claim(std::string_view secret, std::string_view transcript, const std::string& cookie);

// What rank 0 signs for an incarnation it admitted after the world was published.
std::string certificate_statement(int rank, std::uint32_t incarnation, std::string_view public_key);

}  // namespace corpc::detail
