// Which rank a Hello proves it is (src/rpc/hello_proofs.hpp), judged without sockets: each process of a job is a
// HelloProofs of its own, their Hellos are made as the runtime makes them (prove) and judged as the runtime judges
// them (unproven_registration on rank 0, unproven_claim everywhere), with the launcher's key and credentials dealt as
// launch_processes deals them. Each way a claim is refused is checked by the words the refusal says.
#include <doctest/doctest.h>

#include <optional>
#include <string>

#include "../src/rpc/hello_proofs.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_hello_proofs {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

namespace {

constexpr int kWorld = 3;

// What a launcher holding `launcher_key` deals incarnation `incarnation` of `rank` (rank 0 gets the key as well).
RankProofs dealt(const std::string& launcher_key, int rank, std::uint32_t incarnation = 0) {
  RankProofs p;
  if (rank == 0) p.launcher_key = launcher_key;
  if (!launcher_key.empty()) p.credential = rank_credential(launcher_key, rank, incarnation);
  p.incarnation = incarnation;
  return p;
}

// The Hello `from` (claiming `rank`) sends: a registration, or a Hello to `to_rank` on the connection `transcript`.
Hello registration(const HelloProofs& from, int rank) {
  Hello h;
  h.self.rank = rank;
  from.prove(h, /*registering=*/true, -1, {}, HelloSide::dialer);
  return h;
}
Hello claim(const HelloProofs& from, int rank, int to_rank, const std::string& transcript,
            HelloSide side = HelloSide::dialer) {
  Hello h;
  h.self.rank = rank;
  from.prove(h, /*registering=*/false, to_rank, transcript, side);
  return h;
}

std::string refusal(const std::optional<std::string>& why) {
  REQUIRE(why.has_value());
  return *why;
}

// A job whose launcher dealt credentials: rank 0, ranks 1 and 2 as they registered, and the keys they registered with
// known everywhere (as the world table makes them).
struct Job {
  std::string key = random_launcher_key();
  HelloProofs rank0{0, kWorld, dealt(key, 0)};
  HelloProofs rank1{1, kWorld, dealt(key, 1)};
  HelloProofs rank2{2, kWorld, dealt(key, 2)};
  Job() {
    for (HelloProofs* p : {&rank0, &rank1, &rank2}) {
      p->identities().set(0, {0, rank0.public_key()});
      p->identities().set(1, {0, rank1.public_key()});
      p->identities().set(2, {0, rank2.public_key()});
    }
  }
};

}  // namespace

TEST_CASE("HelloProofs: a registration proves the launcher's credential for its rank and incarnation, or is refused") {
  Job job;
  HelloProofs fresh0{0, kWorld, dealt(job.key, 0)};
  CHECK_FALSE(fresh0.unproven_registration(registration(job.rank1, 1), /*replacing=*/false));
  // Another rank's credential, or none at all (a process that holds the secret but was not started as the rank).
  EXPECT_CONTAINS(refusal(fresh0.unproven_registration(registration(job.rank1, 2), false)),
                  "it does not hold the launcher's credential for rank 2, incarnation 0");
  HelloProofs stranger{1, kWorld, RankProofs{}};
  EXPECT_CONTAINS(refusal(fresh0.unproven_registration(registration(stranger, 1), false)),
                  "it does not hold the launcher's credential for rank 1, incarnation 0");
}

TEST_CASE(
    "HelloProofs: a replacement registers as a newer incarnation only, and never where no credentials are dealt") {
  Job job;
  HelloProofs restarted{1, kWorld, dealt(job.key, 1, /*incarnation=*/1)};
  CHECK_FALSE(job.rank0.unproven_registration(registration(restarted, 1), /*replacing=*/true));
  EXPECT_CONTAINS(refusal(job.rank0.unproven_registration(registration(job.rank1, 1), /*replacing=*/true)),
                  "incarnation 0 of rank 1 is not newer than incarnation 0, which registered already");
  HelloProofs no_launcher0{0, kWorld, RankProofs{}};
  HelloProofs no_launcher1{1, kWorld, RankProofs{}};
  CHECK_FALSE(no_launcher0.unproven_registration(registration(no_launcher1, 1), /*replacing=*/false));
  EXPECT_CONTAINS(refusal(no_launcher0.unproven_registration(registration(no_launcher1, 1), /*replacing=*/true)),
                  "a replacement must prove it is rank 1, and this job's launcher deals no rank credentials");
}

TEST_CASE("HelloProofs: a claim is proven for its own connection, side and receiver only") {
  Job job;
  CHECK_FALSE(job.rank2.unproven_claim(claim(job.rank1, 1, 2, "T"), HelloSide::dialer, "T"));
  const std::string no_signature =
      "it cannot prove it is rank 1 (no valid signature of rank 1's key for this connection)";
  // Replayed on another connection, passed off as the acceptor's answer, or shown to a rank it was not made for.
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(job.rank1, 1, 2, "T"), HelloSide::dialer, "U")), no_signature);
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(job.rank1, 1, 2, "T"), HelloSide::acceptor, "T")),
                  no_signature);
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(job.rank1, 1, 0, "T"), HelloSide::dialer, "T")), no_signature);
  // The acceptor's answer is judged the same way, as the acceptor's.
  CHECK_FALSE(job.rank1.unproven_claim(claim(job.rank2, 2, 1, "T", HelloSide::acceptor), HelloSide::acceptor, "T"));
}

TEST_CASE("HelloProofs: a claim under another key, or from an incarnation already replaced, is refused") {
  Job job;
  HelloProofs impostor{1, kWorld, dealt(job.key, 1)};  // rank 1's credential, but not the key rank 1 registered
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(impostor, 1, 2, "T"), HelloSide::dialer, "T")),
                  "its key is not the one rank 1 registered with");
  job.rank2.identities().set(1, {2, job.rank1.public_key()});
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(job.rank1, 1, 2, "T"), HelloSide::dialer, "T")),
                  "it claims incarnation 0 of rank 1, which incarnation 2 replaced");
}

TEST_CASE("HelloProofs: a newer incarnation is taken on rank 0's certificate only, and then known") {
  Job job;
  HelloProofs restarted{1, kWorld, dealt(job.key, 1, /*incarnation=*/1)};
  const std::string uncertified = "it claims incarnation 1 of rank 1 without rank 0's certificate for it";
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(restarted, 1, 2, "T"), HelloSide::dialer, "T")), uncertified);
  restarted.set_certificate(job.rank1.certify(1, 1, restarted.public_key()));  // not rank 0's word
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(restarted, 1, 2, "T"), HelloSide::dialer, "T")), uncertified);
  CHECK(job.rank2.identities().get(1).incarnation == 0);
  restarted.set_certificate(job.rank0.certify(1, 1, restarted.public_key()));
  CHECK_FALSE(job.rank2.unproven_claim(claim(restarted, 1, 2, "T"), HelloSide::dialer, "T"));
  CHECK(job.rank2.identities().get(1).incarnation == 1);
  CHECK(job.rank2.identities().get(1).public_key == restarted.public_key());
  // From then on the predecessor's claims are stale.
  EXPECT_CONTAINS(refusal(job.rank2.unproven_claim(claim(job.rank1, 1, 2, "T"), HelloSide::dialer, "T")),
                  "which incarnation 1 replaced");
}

}  // namespace test_hello_proofs
