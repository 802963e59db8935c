/// @file
/// TLS on the connections between workers: the certificates a worker presents and the CA it checks peers against.
#pragma once

#include <string>

namespace corpc {

/// TLS on every connection between workers, for links that leave the host (RpcOptions::tls). Every rank of a job
/// must use it (a plain peer is refused), with certificates signed by one CA that stands for the job: any certificate
/// it signed is accepted as a rank (host names are not checked; ranks are found by address).
struct TlsOptions {
  /// PEM file: this worker's certificate, then any intermediates. It is presented to every peer.
  std::string certificate_chain_file;
  /// PEM file: the private key of that certificate.
  std::string private_key_file;
  /// PEM file: the CA certificate(s) a peer's certificate must chain to.
  std::string ca_file;
  /// Verify the peer's certificate on both sides of every connection (mutual TLS 1.3). false: encryption only;
  /// peers are then authenticated by the shared secret alone (bound to the TLS session, so a relay that terminates
  /// TLS still fails it), and ca_file may be empty.
  bool verify_peer = true;
};

}  // namespace corpc
