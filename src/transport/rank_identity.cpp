#include "transport/rank_identity.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <array>

#include "corpc/transport/errors.hpp"

#include "transport/mac.hpp"

namespace corpc::detail {

namespace {

constexpr std::size_t kPublicKeyBytes = 32;
constexpr std::size_t kSignatureBytes = 64;

Sha256Mac hmac(std::string_view key, std::string_view message) {
  Sha256Mac out;
  if (!hmac_sha256_into(key, message, out)) throw ConnectionError("rank identity: HMAC failed");
  return out;
}

std::string bytes_of(const Sha256Mac& mac) {
  return std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
}

// Fixed-width fields: no two (rank, incarnation, ...) tuples share an encoding.
void append_u32(std::string& out, std::uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xff);
}
void append_field(std::string& out, std::string_view bytes) {
  append_u32(out, static_cast<std::uint32_t>(bytes.size()));
  out.append(bytes);
}

struct PkeyFree {
  void operator()(EVP_PKEY* p) const noexcept { EVP_PKEY_free(p); }
};
struct MdCtxFree {
  void operator()(EVP_MD_CTX* p) const noexcept { EVP_MD_CTX_free(p); }
};
using Pkey = std::unique_ptr<EVP_PKEY, PkeyFree>;
using MdCtx = std::unique_ptr<EVP_MD_CTX, MdCtxFree>;

}  // namespace

struct RankKey::Impl {
  Pkey key;
};

RankKey::RankKey(std::unique_ptr<Impl> impl, std::string public_key)
    : impl_(std::move(impl)), public_key_(std::move(public_key)) {}
RankKey::RankKey(RankKey&&) noexcept = default;
RankKey& RankKey::operator=(RankKey&&) noexcept = default;
RankKey::~RankKey() = default;

RankKey RankKey::generate() {
  EVP_PKEY* raw = nullptr;
  std::unique_ptr<EVP_PKEY_CTX, decltype(&EVP_PKEY_CTX_free)> ctx(EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, nullptr),
                                                                  EVP_PKEY_CTX_free);
  if (!ctx || EVP_PKEY_keygen_init(ctx.get()) != 1 || EVP_PKEY_keygen(ctx.get(), &raw) != 1)
    throw ConnectionError("rank identity: cannot make a key pair");
  auto impl = std::make_unique<Impl>();
  impl->key.reset(raw);
  std::array<unsigned char, kPublicKeyBytes> pub;
  std::size_t len = pub.size();
  if (EVP_PKEY_get_raw_public_key(raw, pub.data(), &len) != 1 || len != pub.size())
    throw ConnectionError("rank identity: cannot read the public key");
  return RankKey(std::move(impl), std::string(reinterpret_cast<const char*>(pub.data()), len));
}

std::string RankKey::sign(std::string_view message) const {
  MdCtx ctx(EVP_MD_CTX_new());
  std::array<unsigned char, kSignatureBytes> sig;
  std::size_t len = sig.size();
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, impl_->key.get()) != 1 ||
      EVP_DigestSign(ctx.get(), sig.data(), &len, reinterpret_cast<const unsigned char*>(message.data()),
                     message.size()) != 1)
    throw ConnectionError("rank identity: cannot sign");
  return std::string(reinterpret_cast<const char*>(sig.data()), len);
}

bool verify_signature(std::string_view public_key, std::string_view message, std::string_view signature) {
  if (public_key.size() != kPublicKeyBytes || signature.size() != kSignatureBytes) return false;
  Pkey key(EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr,
                                       reinterpret_cast<const unsigned char*>(public_key.data()), public_key.size()));
  MdCtx ctx(EVP_MD_CTX_new());
  if (!key || !ctx || EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, key.get()) != 1) return false;
  return EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                          reinterpret_cast<const unsigned char*>(message.data()), message.size()) == 1;
}

std::string random_launcher_key() {
  std::array<unsigned char, 32> bytes;
  if (!random_bytes(bytes.data(), bytes.size()))
    throw ConnectionError("rank identity: no randomness for a launcher key");
  return hex(bytes.data(), bytes.size());
}

std::string credential_message(int rank, std::uint32_t incarnation) {
  std::string message = "corpc rank credential";
  append_u32(message, static_cast<std::uint32_t>(rank));
  append_u32(message, incarnation);
  return message;
}

std::string rank_credential(std::string_view launcher_key, int rank, std::uint32_t incarnation) {
  return hex(hmac(launcher_key, credential_message(rank, incarnation)));
}

std::string credential_proof(std::string_view credential, std::string_view public_key) {
  std::string message = "corpc registration";
  append_field(message, public_key);
  return bytes_of(hmac(credential, message));
}

std::string channel_claim(std::string_view secret, std::string_view transcript, const std::string& cookie) {
  if (secret.empty()) return cookie;
  std::string message = "corpc same-host channel claim";
  append_field(message, transcript);
  append_field(message, cookie);
  return hex(hmac(secret, message));
}

bool credential_proof_matches(std::string_view credential, std::string_view public_key, std::string_view proof) {
  const std::string expected = credential_proof(credential, public_key);
  return proof.size() == expected.size() && CRYPTO_memcmp(proof.data(), expected.data(), expected.size()) == 0;
}

std::string hello_statement(HelloSide side, int rank, std::uint32_t incarnation, int to_rank,
                            std::string_view transcript) {
  std::string message = side == HelloSide::dialer ? "corpc hello" : "corpc hello answer";
  append_u32(message, static_cast<std::uint32_t>(rank));
  append_u32(message, incarnation);
  append_u32(message, static_cast<std::uint32_t>(to_rank));
  append_field(message, transcript);
  return message;
}

std::string certificate_statement(int rank, std::uint32_t incarnation, std::string_view public_key) {
  std::string message = "corpc rank certificate";
  append_u32(message, static_cast<std::uint32_t>(rank));
  append_u32(message, incarnation);
  append_field(message, public_key);
  return message;
}

}  // namespace corpc::detail
