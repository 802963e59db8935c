// Our Hellos' proofs and the judgement of the peers' (hello_proofs.hpp).
#include "rpc/hello_proofs.hpp"

#include "core/log.hpp"  // fmt, as the rest of the runtime has it

namespace corpc::detail {

HelloProofs::HelloProofs(int rank, int world_size, RankProofs dealt)
    : rank_(rank), dealt_(std::move(dealt)), key_(RankKey::generate()), identities_(world_size) {
  if (rank == 0) identities_.set(0, {dealt_.incarnation, key_.public_key()});
}

void HelloProofs::prove(Hello& h, bool registering, int to_rank, const std::string& transcript, HelloSide side) const {
  h.incarnation = dealt_.incarnation;
  h.public_key = key_.public_key();
  if (registering) {
    if (!dealt_.credential.empty()) h.proof = credential_proof(dealt_.credential, h.public_key);
  } else if (to_rank >= 0) {
    h.proof = key_.sign(hello_statement(side, rank_, h.incarnation, to_rank, transcript));
    h.certificate = certificate_;
  }
}

std::optional<std::string> HelloProofs::unproven_claim(const Hello& hello, HelloSide side,
                                                       const std::string& transcript) {
  const int rank = hello.self.rank;
  const std::string who = "rank " + std::to_string(rank);
  const auto known = identities_.get(rank);
  if (hello.incarnation < known.incarnation)
    return fmt::format("it claims incarnation {} of {}, which incarnation {} replaced", hello.incarnation, who,
                       known.incarnation);
  std::string key = known.public_key;
  if (hello.incarnation > known.incarnation) {
    // A replacement rank 0 admitted after we took the world table: rank 0 vouches for its key.
    if (!verify_signature(identities_.get(0).public_key,
                          certificate_statement(rank, hello.incarnation, hello.public_key), hello.certificate))
      return fmt::format("it claims incarnation {} of {} without rank 0's certificate for it", hello.incarnation, who);
    key = hello.public_key;
  }
  if (key.empty() || hello.public_key != key) return fmt::format("its key is not the one {} registered with", who);
  if (!verify_signature(key, hello_statement(side, rank, hello.incarnation, rank_, transcript), hello.proof))
    return fmt::format("it cannot prove it is {} (no valid signature of {}'s key for this connection)", who, who);
  if (hello.incarnation > known.incarnation) identities_.advance(rank, {hello.incarnation, key});
  return std::nullopt;
}

std::optional<std::string> HelloProofs::unproven_registration(const Hello& hello, bool replacing) {
  const int rank = hello.self.rank;
  const std::string who = "rank " + std::to_string(rank);
  if (dealt_.launcher_key.empty()) {
    // Under a launcher that deals no credentials (torchrun, Slurm) the first registration of a rank is taken as it
    // comes, and its key is the rank from then on; a replacement could be anyone holding the secret.
    if (replacing)
      return "a replacement must prove it is " + who +
             ", and this job's launcher deals no rank credentials (launch_processes and corpcrun do)";
    return std::nullopt;
  }
  const std::string credential = rank_credential(dealt_.launcher_key, rank, hello.incarnation);
  if (!credential_proof_matches(credential, hello.public_key, hello.proof))
    return fmt::format("it does not hold the launcher's credential for {}, incarnation {}", who, hello.incarnation);
  if (replacing) {
    const auto known = identities_.get(rank);
    if (hello.incarnation <= known.incarnation)
      return fmt::format("incarnation {} of {} is not newer than incarnation {}, which registered already",
                         hello.incarnation, who, known.incarnation);
  }
  return std::nullopt;
}

std::string HelloProofs::certify(int rank, std::uint32_t incarnation, const std::string& public_key) const {
  return key_.sign(certificate_statement(rank, incarnation, public_key));
}

}  // namespace corpc::detail
