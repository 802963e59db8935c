#include "transport/frame_seal.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "corpc/transport/errors.hpp"

namespace corpc::detail {

FrameSeal::FrameSeal(std::string_view key) : ctx_(EVP_CIPHER_CTX_new()) {
  // The key schedule and GHASH's tables are made once here; a frame only sets its IV.
  if (!ctx_ || key.size() != 32 ||
      EVP_EncryptInit_ex(ctx_, EVP_aes_256_gcm(), nullptr, reinterpret_cast<const unsigned char*>(key.data()),
                         nullptr) != 1) {
    EVP_CIPHER_CTX_free(ctx_);
    throw ConnectionError("frame integrity: cannot set up AES-256-GCM");
  }
}

FrameSeal::~FrameSeal() { EVP_CIPHER_CTX_free(ctx_); }

void FrameSeal::begin() {
  // GCM's 96-bit IV: the frame number; one key per direction and connection, so an IV is never used twice.
  unsigned char iv[12] = {};
  const std::uint64_t n = next_++;
  std::memcpy(iv + 4, &n, sizeof n);
  if (EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, iv) != 1)
    throw ConnectionError("frame integrity: cannot start a frame's tag");
}

void FrameSeal::add(const void* data, std::size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  while (size) {
    // Authenticated-only data: GHASH, with no output; EVP takes an int length, hence the chunks.
    const int n = static_cast<int>(std::min<std::size_t>(size, std::size_t{1} << 30));
    int ignored = 0;
    if (EVP_EncryptUpdate(ctx_, nullptr, &ignored, p, n) != 1)
      throw ConnectionError("frame integrity: cannot add to a frame's tag");
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

FrameSeal::Tag FrameSeal::tag() {
  Tag t;
  int ignored = 0;
  unsigned char none[16];
  if (EVP_EncryptFinal_ex(ctx_, none, &ignored) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, static_cast<int>(t.size()), t.data()) != 1)
    throw ConnectionError("frame integrity: cannot finish a frame's tag");
  return t;
}

bool FrameSeal::matches(const unsigned char* expected) {
  const Tag t = tag();
  return CRYPTO_memcmp(t.data(), expected, t.size()) == 0;
}

}  // namespace corpc::detail
