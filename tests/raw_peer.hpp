// A raw connection to a worker (its TCP port, or its Unix socket for peers on its host), for tests that play a
// misbehaving peer below the RPC layer.
#pragma once

#include <asio.hpp>
#include <array>
#include <chrono>
#include <exception>
#include <fstream>
#include <string>
#include <utility>

#include "../src/rpc/environment.hpp"
#include "../src/transport/auth.hpp"
#include "corpc/rpc/worker_info.hpp"
#include "../src/transport/frames.hpp"

namespace corpc {
// The Hello a dialing worker sends first (src/rpc/rendezvous.cpp), for tests that impersonate one.
detail::Message hello_message(const WorkerInfo& self, int world_size, bool rendezvous, const WireLimits& limits);
}  // namespace corpc

namespace corpc::test {

inline asio::ip::tcp::socket raw_socket(asio::io_context& io, const WorkerInfo& target) {
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address(target.host), target.port});
  return s;
}

// The name of the abstract Unix socket on which process `pid` takes connections from its host ("" if none).
inline std::string rpc_socket_of(int pid) {
  std::ifstream in("/proc/self/net/unix");
  const std::string prefix = "@corpc-rpc-" + std::to_string(pid) + "-";
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find(prefix);
    if (at != std::string::npos) return line.substr(at + 1);
  }
  return {};
}

// A raw connection to that socket, in the socket object the helpers below take (as the worker's own connections do).
inline asio::ip::tcp::socket raw_local_socket(asio::io_context& io, const std::string& name) {
  asio::local::stream_protocol::socket unix_socket(io);
  unix_socket.connect(asio::local::stream_protocol::endpoint(std::string(1, '\0') + name));
  asio::ip::tcp::socket s(io);
  s.assign(asio::ip::tcp::v4(), unix_socket.release());
  return s;
}

// `s` once it has passed the handshake as `config` says (TLS, a secret): a peer that may then misbehave. Throws
// ConnectionError if the worker refuses it.
inline detail::Transport authenticated_transport(asio::io_context& io, asio::ip::tcp::socket s,
                                                 const detail::AuthConfig& config) {
  detail::Transport t(std::move(s));
  std::exception_ptr error;
  asio::co_spawn(io, detail::authenticate(t, config, detail::AuthRole::dialer),
                 [&](std::exception_ptr e) { error = e; });
  io.run();
  io.restart();
  if (error) std::rethrow_exception(error);
  return t;
}
inline detail::Transport authenticated_transport(asio::io_context& io, const WorkerInfo& target,
                                                 const detail::AuthConfig& config) {
  return authenticated_transport(io, raw_socket(io, target), config);
}

// A plain connection that has passed the handshake with `secret` (by default this run's, from CORPC_SECRET): a peer
// that knows the secret and then misbehaves. Throws ConnectionError if the worker refuses it.
inline asio::ip::tcp::socket authenticated_socket(asio::io_context& io, asio::ip::tcp::socket s,
                                                  std::string secret = detail::secret_from_environment()) {
  detail::AuthConfig config{std::move(secret), std::chrono::seconds(10), nullptr};
  return std::move(authenticated_transport(io, std::move(s), config).socket());
}
inline asio::ip::tcp::socket authenticated_socket(asio::io_context& io, const WorkerInfo& target,
                                                  std::string secret = detail::secret_from_environment()) {
  return authenticated_socket(io, raw_socket(io, target), std::move(secret));
}

// Writes a Hello that claims to be `who` in a world of `world_size` on `s`, as a dialing worker's first frame, without
// any handshake first; the error, if the worker has hung up already.
inline asio::error_code write_raw_hello(asio::ip::tcp::socket& s, const WorkerInfo& who, int world_size) {
  detail::OutFrame f = detail::prepare(hello_message(who, world_size, false, WireLimits{}));
  asio::error_code ec;
  asio::write(s, std::array<asio::const_buffer, 2>{asio::buffer(&f.head, sizeof f.head), asio::buffer(f.body)}, ec);
  return ec;
}

// True once the worker has closed `s` (reads until EOF or an error, discarding what arrives).
inline bool hung_up(asio::ip::tcp::socket& s) {
  char buf[256];
  asio::error_code ec;
  while (!ec) s.read_some(asio::buffer(buf), ec);
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

}  // namespace corpc::test
