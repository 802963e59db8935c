// Which process is each rank: its incarnation and the public key it proved at registration (transport/rank_identity.hpp
// says how). Rank 0 fills the table as ranks register and publishes it with the world; every rank then checks the
// claims of the connections it accepts against it, and takes a newer incarnation only with rank 0's certificate.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "corpc/wire/codec.hpp"

namespace corpc::detail {

struct RankIdentity {
  std::uint32_t incarnation = 0;
  std::string public_key;  // empty: not known (a rank that has not registered yet)
  bool operator==(const RankIdentity&) const = default;
  CORPC_FIELDS(incarnation, public_key)
};

class RankIdentities {
 public:
  explicit RankIdentities(int world_size = 0) : table_(static_cast<std::size_t>(world_size)) {}

  void resize(int world_size) {
    std::lock_guard lock(mutex_);
    table_.resize(static_cast<std::size_t>(world_size));
  }
  RankIdentity get(int rank) const {
    std::lock_guard lock(mutex_);
    return table_.at(static_cast<std::size_t>(rank));
  }
  std::vector<RankIdentity> all() const {
    std::lock_guard lock(mutex_);
    return table_;
  }
  void set_all(std::vector<RankIdentity> table) {
    std::lock_guard lock(mutex_);
    table_ = std::move(table);
  }
  void set(int rank, RankIdentity identity) {
    std::lock_guard lock(mutex_);
    table_.at(static_cast<std::size_t>(rank)) = std::move(identity);
  }
  // Takes `identity` for `rank` if it is a newer incarnation than the one known; false (nothing changed) otherwise.
  bool advance(int rank, RankIdentity identity) {
    std::lock_guard lock(mutex_);
    auto& known = table_.at(static_cast<std::size_t>(rank));
    if (!known.public_key.empty() && identity.incarnation <= known.incarnation) return false;
    known = std::move(identity);
    return true;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<RankIdentity> table_;
};

}  // namespace corpc::detail
