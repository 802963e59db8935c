#include "transport/mac.hpp"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace corpc::detail {

bool random_bytes(unsigned char* out, std::size_t n) noexcept { return RAND_bytes(out, static_cast<int>(n)) == 1; }

void hex_into(const unsigned char* bytes, std::size_t n, char* out) noexcept {
  static constexpr char digits[] = "0123456789abcdef";
  for (std::size_t i = 0; i < n; ++i) {
    out[2 * i] = digits[bytes[i] >> 4];
    out[2 * i + 1] = digits[bytes[i] & 15];
  }
}

std::string hex(const unsigned char* bytes, std::size_t n) {
  std::string out(2 * n, '\0');
  hex_into(bytes, n, out.data());
  return out;
}

bool hmac_sha256_into(std::string_view key, std::string_view message, Sha256Mac& out) noexcept {
  unsigned int len = 0;
  return HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
              reinterpret_cast<const unsigned char*>(message.data()), message.size(), out.data(), &len) != nullptr &&
         len == out.size();
}

}  // namespace corpc::detail
