// Throwaway certificates for TLS tests and benchmarks, made at run time with OpenSSL's C API (no `openssl` binary
// needed, nothing committed): a CA and certificates it signs, EC P-256 keys, SHA-256 signatures, unencrypted PEM
// files in a fresh temporary directory that is removed with the object. Never use these for real jobs.
#pragma once

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>

#include "corpc/rpc/options.hpp"

namespace corpc::test {

class ThrowawayPki {
 public:
  // A CA named `ca_name`, written to <dir>/ca.pem.
  explicit ThrowawayPki(const std::string& ca_name = "corpc throwaway test CA") {
    char tmpl[] = "/tmp/corpc-tls-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("ThrowawayPki: mkdtemp failed");
    dir_ = tmpl;
    ca_key_.reset(new_key());
    ca_cert_.reset(make_cert(ca_name, ca_key_.get(), nullptr, nullptr, true, false));
    write_cert(ca_cert_.get(), ca_file());
  }
  ~ThrowawayPki() {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  ThrowawayPki(const ThrowawayPki&) = delete;
  ThrowawayPki& operator=(const ThrowawayPki&) = delete;

  std::string ca_file() const { return dir_ + "/ca.pem"; }
  const std::string& dir() const { return dir_; }

  // A certificate for `name` signed by this CA (valid from an hour ago for a day, or expired an hour ago), and its
  // key; returns TlsOptions presenting it and trusting this CA.
  TlsOptions issue(const std::string& name, bool expired = false) const {
    std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(new_key(), EVP_PKEY_free);
    std::unique_ptr<X509, decltype(&X509_free)> cert(
        make_cert(name, key.get(), ca_cert_.get(), ca_key_.get(), false, expired), X509_free);
    TlsOptions o;
    o.certificate_chain_file = dir_ + "/" + name + ".pem";
    o.private_key_file = dir_ + "/" + name + ".key";
    o.ca_file = ca_file();
    write_cert(cert.get(), o.certificate_chain_file);
    write_key(key.get(), o.private_key_file);
    return o;
  }

  // The CA's own certificate and key, as a self-signed certificate a rank could present.
  TlsOptions self_signed() const {
    TlsOptions o;
    o.certificate_chain_file = ca_file();
    o.private_key_file = dir_ + "/ca.key";
    o.ca_file = ca_file();
    write_key(ca_key_.get(), o.private_key_file);
    return o;
  }

 private:
  static EVP_PKEY* new_key() {
    EVP_PKEY* k = EVP_EC_gen("P-256");
    if (!k) throw std::runtime_error("ThrowawayPki: EC key generation failed");
    return k;
  }

  static void add_ext(X509* cert, X509* issuer, int nid, const char* value) {
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, issuer ? issuer : cert, cert, nullptr, nullptr, 0);
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    if (!ext || X509_add_ext(cert, ext, -1) != 1) throw std::runtime_error("ThrowawayPki: cannot add an extension");
    X509_EXTENSION_free(ext);
  }

  // issuer == nullptr: self-signed with `key`.
  static X509* make_cert(const std::string& name, EVP_PKEY* key, X509* issuer, EVP_PKEY* issuer_key, bool ca,
                         bool expired) {
    static long serial = 1;
    X509* x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), serial++);
    X509_gmtime_adj(X509_getm_notBefore(x), expired ? -2 * 86400 : -3600);
    X509_gmtime_adj(X509_getm_notAfter(x), expired ? -3600 : 86400);
    X509_set_pubkey(x, key);
    X509_NAME* subject = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(name.c_str()), -1,
                               -1, 0);
    X509_set_issuer_name(x, issuer ? X509_get_subject_name(issuer) : subject);
    add_ext(x, issuer, NID_basic_constraints, ca ? "critical,CA:TRUE" : "critical,CA:FALSE");
    add_ext(x, issuer, NID_key_usage, ca ? "critical,keyCertSign,cRLSign" : "critical,digitalSignature");
    add_ext(x, issuer, NID_subject_key_identifier, "hash");
    if (X509_sign(x, issuer_key ? issuer_key : key, EVP_sha256()) == 0)
      throw std::runtime_error("ThrowawayPki: signing failed");
    return x;
  }

  static void write_cert(X509* cert, const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f || PEM_write_X509(f, cert) != 1) throw std::runtime_error("ThrowawayPki: cannot write " + path);
    std::fclose(f);
  }
  static void write_key(EVP_PKEY* key, const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f || PEM_write_PrivateKey(f, key, nullptr, nullptr, 0, nullptr, nullptr) != 1)
      throw std::runtime_error("ThrowawayPki: cannot write " + path);
    std::fclose(f);
  }

  std::string dir_;
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> ca_key_{nullptr, EVP_PKEY_free};
  std::unique_ptr<X509, decltype(&X509_free)> ca_cert_{nullptr, X509_free};
};

}  // namespace corpc::test
