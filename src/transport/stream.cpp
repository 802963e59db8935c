#include "transport/stream.hpp"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>

#include <cstdlib>

#include "corpc/transport/errors.hpp"
#include "corpc/transport/tls.hpp"
#include "corpc/wire/errors.hpp"

namespace corpc::detail {

namespace {

// OpenSSL's reason for the last failure of a context call, e.g. "no such file" or "key values mismatch".
std::string last_openssl_error() {
  std::string why;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    why = buf;  // the first queued error is the deepest; the last one says what failed at our level
  }
  return why.empty() ? std::string("unknown error") : why;
}

void check(int ok, const std::string& what) {
  if (ok != 1) throw UsageError("TLS: cannot use " + what + ": " + last_openssl_error());
}

}  // namespace

std::shared_ptr<asio::ssl::context> make_tls_context(const TlsOptions& options) {
  if (options.certificate_chain_file.empty() || options.private_key_file.empty())
    throw UsageError(
        "TLS needs a certificate chain file and a private key file (RpcOptions::tls, CORPC_TLS_CERT, CORPC_TLS_KEY)");
  if (options.verify_peer && options.ca_file.empty())
    throw UsageError(
        "TLS with verify_peer needs a CA file to verify peers against (RpcOptions::tls.ca_file, CORPC_TLS_CA)");
  auto ctx = std::make_shared<asio::ssl::context>(asio::ssl::context::tls);
  SSL_CTX* native = ctx->native_handle();
  ERR_clear_error();
  check(SSL_CTX_set_min_proto_version(native, TLS1_3_VERSION), "TLS 1.3");
  // Ranks never resume sessions: no tickets to send after each handshake.
  SSL_CTX_set_num_tickets(native, 0);
  check(SSL_CTX_use_certificate_chain_file(native, options.certificate_chain_file.c_str()),
        "certificate chain " + options.certificate_chain_file);
  check(SSL_CTX_use_PrivateKey_file(native, options.private_key_file.c_str(), SSL_FILETYPE_PEM),
        "private key " + options.private_key_file);
  check(SSL_CTX_check_private_key(native), "private key " + options.private_key_file + " with its certificate");
  if (!options.ca_file.empty())
    check(SSL_CTX_load_verify_locations(native, options.ca_file.c_str(), nullptr), "CA file " + options.ca_file);
  // Mutual: the acceptor asks for the dialer's certificate and refuses a connection without one.
  ctx->set_verify_mode(options.verify_peer ? asio::ssl::verify_peer | asio::ssl::verify_fail_if_no_peer_cert
                                           : asio::ssl::verify_none);
  return ctx;
}

asio::awaitable<void> Transport::start_tls(asio::ssl::context& context, AuthRole role) {
  asio::error_code ignored;
  s_->socket.set_option(asio::ip::tcp::no_delay(true), ignored);  // the handshake's small flights must not wait
  auto& tls = s_->tls.emplace(s_->socket, context);
  std::string failure;
  try {
    co_await tls.async_handshake(
        role == AuthRole::dialer ? asio::ssl::stream_base::client : asio::ssl::stream_base::server,
        asio::use_awaitable);
    co_return;
  } catch (const std::system_error& e) {
    failure = e.code().message();
    const long verdict = SSL_get_verify_result(tls.native_handle());
    if (verdict != X509_V_OK) {
      failure += std::string(" (") + X509_verify_cert_error_string(verdict) + ")";
    } else if (e.code().category() == asio::error::get_ssl_category() &&
               ERR_GET_REASON(static_cast<unsigned long>(e.code().value())) == SSL_R_WRONG_VERSION_NUMBER) {
      failure += " (the peer does not speak TLS: is RpcOptions::tls / CORPC_TLS_CERT set on every rank?)";
      // A plain corpc dialer speaks first and reads what comes back: a fatal protocol_version alert, the one OpenSSL
      // queued and Asio does not send after a failed handshake, tells it that this worker expects TLS.
      if (role == AuthRole::acceptor) {
        static constexpr unsigned char kAlert[] = {0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46};
        (void)::send(s_->socket.native_handle(), kAlert, sizeof kAlert, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    } else if (e.code() == asio::error::eof || e.code() == asio::ssl::error::stream_truncated) {
      failure += " (the peer hung up during the TLS handshake: it may not use TLS, or may not trust our certificate)";
    }
  }
  throw ConnectionError("TLS handshake failed: " + failure);
}

std::string Transport::channel_binding() {
  if (!s_->tls) return {};
  static constexpr char kLabel[] = "EXPORTER-corpc-authentication";
  std::string out(32, '\0');
  if (SSL_export_keying_material(s_->tls->native_handle(), reinterpret_cast<unsigned char*>(out.data()), out.size(),
                                 kLabel, sizeof kLabel - 1, nullptr, 0, 0) != 1)
    throw ConnectionError("TLS: no keying material to bind the authentication to");
  return out;
}

}  // namespace corpc::detail
