// A raw connection to a worker (its TCP port, or its Unix socket for peers on its host), for tests that play a
// misbehaving peer below the RPC layer.
#pragma once

#include <asio.hpp>

#include <array>
#include <chrono>
#include <exception>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "corpc/rpc/worker_info.hpp"

#include "../src/rpc/environment.hpp"
#include "../src/transport/auth.hpp"
#include "../src/transport/frame_seal.hpp"
#include "../src/transport/frames.hpp"

namespace corpc {
// The Hello a dialing worker sends first (src/rpc/rendezvous.cpp), for tests that impersonate one.
detail::Message hello_message(const WorkerInfo& self, int world_size, bool rendezvous, const WireLimits& limits);
}  // namespace corpc

namespace corpc::test {

// How the raw connections this process opened seal the frames they send (src/transport/frame_seal.hpp), by descriptor:
// a peer that knows the secret seals its frames as a worker does, or it is refused for that before anything it says
// is read. No entry: the connection's frames are not sealed (no secret, TLS, or not authenticated).
inline std::map<int, std::shared_ptr<detail::FrameSeal>>& raw_seals() {
  static std::map<int, std::shared_ptr<detail::FrameSeal>> seals;
  return seals;
}
inline void forget_seal(const asio::ip::tcp::socket& s) {
  raw_seals().erase(const_cast<asio::ip::tcp::socket&>(s).native_handle());
}
inline bool is_sealed(asio::ip::tcp::socket& s) { return raw_seals().count(s.native_handle()) > 0; }

// `bytes` (frames back to back; the last may be cut short) as `s` sends them: each whole frame followed by its tag
// when the connection seals its frames. What is cut short goes as it is (its tag would follow its last byte).
inline std::string sealed(asio::ip::tcp::socket& s, const std::string& bytes) {
  auto found = raw_seals().find(s.native_handle());
  if (found == raw_seals().end()) return bytes;
  detail::FrameSeal& seal = *found->second;
  std::string out;
  std::size_t at = 0;
  while (bytes.size() - at >= sizeof(detail::FrameHeader)) {
    detail::FrameHeader h;
    std::memcpy(&h, bytes.data() + at, sizeof h);
    const std::uint64_t on_socket = (h.flags & detail::kFlagShm) ? 0 : h.tensor_bytes;
    const std::uint64_t len = sizeof h + std::uint64_t{h.meta_len} + h.body_len + on_socket;
    if (bytes.size() - at < len) break;
    seal.begin();
    seal.add(bytes.data() + at, len);
    const auto tag = seal.tag();
    out.append(bytes, at, len);
    out.append(reinterpret_cast<const char*>(tag.data()), tag.size());
    at += len;
  }
  out.append(bytes, at, std::string::npos);
  return out;
}

inline asio::ip::tcp::socket raw_socket(asio::io_context& io, const WorkerInfo& target) {
  asio::ip::tcp::socket s(io);
  s.connect({asio::ip::make_address(target.host), target.port});
  forget_seal(s);
  return s;
}

// The name of the abstract Unix socket on which process `pid` takes connections from its host ("" if none). Looked for
// a few times: the kernel lists the table a page at a time, and on a busy host, whose sockets come and go between
// pages, a row may be left out of one reading.
inline std::string rpc_socket_of(int pid) {
  const std::string prefix = "@corpc-rpc-" + std::to_string(pid) + "-";
  for (int reading = 0; reading < 5; ++reading) {
    std::ifstream in("/proc/self/net/unix");
    for (std::string line; std::getline(in, line);) {
      const auto at = line.find(prefix);
      if (at != std::string::npos) return line.substr(at + 1);
    }
  }
  return {};
}

// A raw connection to that socket, in the socket object the helpers below take (as the worker's own connections do).
inline asio::ip::tcp::socket raw_local_socket(asio::io_context& io, const std::string& name) {
  asio::local::stream_protocol::socket unix_socket(io);
  unix_socket.connect(asio::local::stream_protocol::endpoint(std::string(1, '\0') + name));
  asio::ip::tcp::socket s(io);
  s.assign(asio::ip::tcp::v4(), unix_socket.release());
  forget_seal(s);
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
  detail::Transport t = authenticated_transport(io, std::move(s), config);
  if (!t.session_keys().send_key.empty())
    raw_seals()[t.socket().native_handle()] = std::make_shared<detail::FrameSeal>(t.session_keys().send_key);
  return std::move(t.socket());
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
  asio::write(s, asio::buffer(sealed(s, std::string(reinterpret_cast<const char*>(&f.head), sizeof f.head) + f.body)),
              ec);
  return ec;
}

// Runs `io` until `finished` is set by the handler of what was started on `s`, for 20 s at most (then that is
// cancelled: its handler sees operation_aborted). Returns false if the 20 s passed.
inline bool run_until(asio::io_context& io, asio::ip::tcp::socket& s, const bool& finished) {
  bool expired = false;
  asio::steady_timer timer(io, std::chrono::seconds(20));
  timer.async_wait([&](const asio::error_code& ec) {
    if (!ec) {
      expired = true;
      s.cancel();
    }
  });
  io.restart();
  while (!finished && io.run_one()) {}
  timer.cancel();
  io.run();  // the timer's handler
  return !expired;
}

// True once the worker has closed `s` (what arrives is dropped); false if it is still open after 20 s.
inline bool hung_up_within(asio::io_context& io, asio::ip::tcp::socket& s) {
  char buf[4096];
  bool finished = false;
  asio::error_code result;
  std::function<void()> read_on = [&] {
    s.async_read_some(asio::buffer(buf), [&](const asio::error_code& ec, std::size_t) {
      if (!ec) return read_on();
      result = ec;
      finished = true;
    });
  };
  read_on();
  return run_until(io, s, finished) && (result == asio::error::eof || result == asio::error::connection_reset);
}

// True once the worker has closed `s` (reads until EOF or an error, discarding what arrives).
inline bool hung_up(asio::ip::tcp::socket& s) {
  char buf[256];
  asio::error_code ec;
  while (!ec) s.read_some(asio::buffer(buf), ec);
  return ec == asio::error::eof || ec == asio::error::connection_reset;
}

}  // namespace corpc::test
