// Frame integrity without TLS (internal): every frame a connection carries is followed by a 16-byte tag, AES-256-GCM's
// GMAC over the frame's bytes as written (header, metadata, body, the tensor data that travels on the socket), under a
// key per direction that only the two ends of this connection hold (derived by the handshake from the secret and both
// nonces: stream.hpp's SessionKeys). The tag's IV is the frame's number on the connection, so a frame cannot be
// altered, dropped unnoticed from the middle, replayed, reordered or moved to another connection: a process on the
// path (a relay at a stale address) can only cut the connection. Tensor data in the same-host channel's ring is not
// covered: it never travels through anyone but the two processes that share the ring.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

typedef struct evp_cipher_ctx_st EVP_CIPHER_CTX;

namespace corpc::detail {

class FrameSeal {
 public:
  static constexpr std::size_t kTagBytes = 16;
  using Tag = std::array<unsigned char, kTagBytes>;

  // `key`: 32 bytes. Throws ConnectionError if OpenSSL cannot set the cipher up.
  explicit FrameSeal(std::string_view key);
  ~FrameSeal();
  FrameSeal(const FrameSeal&) = delete;
  FrameSeal& operator=(const FrameSeal&) = delete;

  // One frame: begin(), add() its bytes in wire order, then tag() (the sender) or matches() (the receiver). Each
  // begin() takes the next frame number.
  void begin();
  void add(const void* data, std::size_t size);
  Tag tag();
  bool matches(const unsigned char* tag);  // constant time

 private:
  EVP_CIPHER_CTX* ctx_ = nullptr;
  std::uint64_t next_ = 0;
};

}  // namespace corpc::detail
