#include "transport/launcher_key.hpp"

#include <openssl/crypto.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <string>

#include "corpc/core/errors.hpp"

#include "transport/mac.hpp"
#include "transport/rank_identity.hpp"

namespace corpc::detail {

// Everything that is or holds the key. Nothing outside this page ever holds it, but a RankSecrets for rank 0.
struct LauncherKey::Page {
  std::array<unsigned char, 32> random;  // the key's bytes, wiped once hex-encoded
  std::array<char, 64> hex;              // the key, as rank_credential and rank 0 take it
  Sha256Mac mac;                         // a credential being made, wiped once hex-encoded
};

namespace {

std::size_t key_page_bytes() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

}  // namespace

LauncherKey::LauncherKey() {
  static_assert(sizeof(Page) <= 4096);
  void* mapped = ::mmap(nullptr, key_page_bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED)
    throw RpcError(std::string("launch_processes: cannot map a page for the run's key: ") + std::strerror(errno));
  // Children get zeros in its place; on kernels before 4.14, no page at all (no child touches it: a forked rank gets
  // what it needs in a RankSecrets).
  if (::madvise(mapped, key_page_bytes(), MADV_WIPEONFORK) != 0 &&
      ::madvise(mapped, key_page_bytes(), MADV_DONTFORK) != 0) {
    const int error = errno;
    ::munmap(mapped, key_page_bytes());
    throw RpcError(std::string("launch_processes: cannot keep the run's key out of forked ranks (madvise: ") +
                   std::strerror(error) + ")");
  }
  // Nor in a core dump; a kernel that refuses it changes nothing else.
  ::madvise(mapped, key_page_bytes(), MADV_DONTDUMP);
  page_ = new (mapped) Page{};
  if (!random_bytes(page_->random.data(), page_->random.size())) {
    ::munmap(mapped, key_page_bytes());
    throw RpcError("launch_processes: no randomness for the run's key");
  }
  hex_into(page_->random.data(), page_->random.size(), page_->hex.data());
  OPENSSL_cleanse(page_->random.data(), page_->random.size());
}

LauncherKey::~LauncherKey() {
  OPENSSL_cleanse(page_, sizeof(Page));
  ::munmap(page_, key_page_bytes());
}

RankSecrets::RankSecrets(const LauncherKey& key, int rank, std::uint32_t incarnation) {
  auto& page = *key.page_;
  // rank_credential's MAC (src/transport/rank_identity.hpp), which rank 0 recomputes to check the rank's
  // registration, made here so that neither the key nor the credential passes through a string that is freed
  // unwiped; its message holds nothing secret.
  const std::string message = credential_message(rank, incarnation);
  const bool made = hmac_sha256_into(std::string_view(page.hex.data(), page.hex.size()), message, page.mac);
  if (made) hex_into(page.mac.data(), page.mac.size(), credential_.data());
  OPENSSL_cleanse(page.mac.data(), page.mac.size());
  if (!made) throw RpcError("launch_processes: HMAC failed making a rank's credential");
  if (rank == 0) {
    std::memcpy(key_.data(), page.hex.data(), key_.size());
    has_key_ = true;
  }
}

RankSecrets::~RankSecrets() {
  OPENSSL_cleanse(credential_.data(), credential_.size());
  OPENSSL_cleanse(key_.data(), key_.size());
}

}  // namespace corpc::detail
