// The few primitives every credential in the transport is made of: random bytes, lowercase hex, HMAC-SHA256.
// One home for them (auth.cpp, rank_identity.cpp and launcher_key.cpp use them). No libtorch, no allocation in the
// *_into forms: launcher_key.cpp keeps its secrets in a locked page and must not copy them anywhere else.
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>

namespace corpc::detail {

using Sha256Mac = std::array<unsigned char, 32>;

// Fills `out` with `n` bytes from OpenSSL's generator; false if it has none to give.
[[nodiscard]] bool random_bytes(unsigned char* out, std::size_t n) noexcept;

// Writes `n` bytes' lowercase hex at `out` (2n characters).
void hex_into(const unsigned char* bytes, std::size_t n, char* out) noexcept;
std::string hex(const unsigned char* bytes, std::size_t n);
inline std::string hex(const Sha256Mac& mac) { return hex(mac.data(), mac.size()); }

// HMAC-SHA256 of `message` under `key` into `out`; false if OpenSSL failed. OpenSSL wipes its own copies of the key.
[[nodiscard]] bool hmac_sha256_into(std::string_view key, std::string_view message, Sha256Mac& out) noexcept;

}  // namespace corpc::detail
