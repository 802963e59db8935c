// The launcher key of one launch_processes run (src/transport/rank_identity.hpp), held so that a forked rank other
// than rank 0 never has it in its memory. Private to the launcher.
//
// fork copies the caller's whole memory into each rank, so a key in an ordinary string would sit in every forked rank,
// and any of them could mint the credential of any rank's next incarnation. So the key is made, hex-encoded and used
// only in a page of its own that the kernel hands to children as zeros (MADV_WIPEONFORK), and what one start of a
// rank needs (its credential; for rank 0 the key itself) is copied out just before that rank's fork and wiped in the
// launcher right after it: a later rank inherits none of it.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

namespace corpc::detail {

class LauncherKey;

// What the launcher deals one start of a rank: its credential, and for rank 0 the key. In ordinary memory, since a
// forked rank must inherit it; wiped when it goes out of scope, so make it just before the rank's start.
class RankSecrets {
 public:
  RankSecrets(const LauncherKey& key, int rank, std::uint32_t incarnation);
  RankSecrets(const RankSecrets&) = delete;
  RankSecrets& operator=(const RankSecrets&) = delete;
  ~RankSecrets();

  std::string_view credential() const noexcept { return {credential_.data(), credential_.size()}; }
  // The run's key, hex: rank 0's only, empty for every other rank.
  std::string_view key() const noexcept { return {key_.data(), has_key_ ? key_.size() : 0}; }

 private:
  std::array<char, 64> credential_{};
  std::array<char, 64> key_{};
  bool has_key_ = false;
};

// A fresh random key, in a page of its own that forked children see as zeros (or, on a kernel without
// MADV_WIPEONFORK, do not have at all).
class LauncherKey {
 public:
  LauncherKey();
  LauncherKey(const LauncherKey&) = delete;
  LauncherKey& operator=(const LauncherKey&) = delete;
  ~LauncherKey();

 private:
  friend class RankSecrets;
  struct Page;
  Page* page_;
};

}  // namespace corpc::detail
