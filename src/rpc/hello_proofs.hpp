// Which rank this process is, and which rank each peer is, proven (transport/rank_identity.hpp says how): our key
// pair, what the launcher dealt us, rank 0's certificate for our incarnation when we replaced a rank after the world
// was published, and every rank's incarnation and key. It signs our Hellos and judges the peers' from the Hello and
// the connection's handshake transcript alone, so each way a claim is refused is tested without sockets.
// Threads: the identities guard themselves; the certificate is written once, by on_world before init_rpc returns.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "rpc/environment.hpp"
#include "rpc/hello.hpp"
#include "rpc/rank_identities.hpp"
#include "transport/rank_identity.hpp"

namespace corpc::detail {

class HelloProofs {
 public:
  // Rank `rank` of `world_size`, with what its launcher dealt it (`dealt`), under a key pair made now. Rank 0 knows
  // its own identity at once; the others learn every rank's with the world table.
  HelloProofs(int rank, int world_size, RankProofs dealt);

  std::uint32_t incarnation() const noexcept { return dealt_.incarnation; }
  const std::string& public_key() const noexcept { return key_.public_key(); }
  // Every rank's incarnation and key: rank 0 fills it as ranks register, the others take it with the world table; a
  // newer incarnation replaces one under its lock.
  RankIdentities& identities() noexcept { return identities_; }
  // Rank 0's word for our incarnation, from the world table (empty: we did not replace a rank).
  void set_certificate(std::string certificate) { certificate_ = std::move(certificate); }

  // Fills in what proves that `h`, our Hello, comes from us: our incarnation and key, and for a registration (to
  // rank 0) the launcher's credential bound to the key, for a Hello to `to_rank` a signature for the connection whose
  // handshake `transcript` is, as `side`'s, with rank 0's certificate if we have one.
  void prove(Hello& h, bool registering, int to_rank, const std::string& transcript, HelloSide side) const;
  // Why a Hello's claim of its rank and incarnation is not proven for `transcript` as `side`'s, or nullopt; a newer
  // incarnation with rank 0's certificate is taken into identities().
  std::optional<std::string> unproven_claim(const Hello& hello, HelloSide side, const std::string& transcript);
  // Rank 0: why a registration's claim is not proven (the launcher's credential), or nullopt. `replacing`: it claims
  // a rank that registered already (RpcOptions::rejoin).
  std::optional<std::string> unproven_registration(const Hello& hello, bool replacing);
  // Rank 0: its word for incarnation `incarnation` of `rank`, with key `public_key`, admitted after the world was
  // published.
  std::string certify(int rank, std::uint32_t incarnation, const std::string& public_key) const;

 private:
  int rank_;
  RankProofs dealt_;
  RankKey key_;
  std::string certificate_;
  RankIdentities identities_;
};

}  // namespace corpc::detail
