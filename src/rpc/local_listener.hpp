// Connections from peers on this host over an abstract Unix socket instead of TCP. The stream, the handshake and
// everything after it are the same; what differs is the kernel's path: no TCP state machine, no loopback softirq,
// so a new connection costs ~0.6x as much and a small call's round trip ~0.8x (docs/benchmarks.md). A dialer uses it
// when the world table (or a rejoined rank's Hello) says the peer is on its host, and TCP when the socket is not there
// or refuses it (a full backlog: a Unix connect does not wait). Threads: the main I/O thread, after start.
#pragma once

#include <asio.hpp>

#include <optional>
#include <string>

#include "rpc/hello.hpp"

namespace corpc::detail {

class LocalListener {
 public:
  // What the listener needs of the runtime: where the sockets it accepts go.
  class Host {
   public:
    virtual ~Host() = default;
    // The I/O thread a new connection belongs to.
    virtual asio::io_context& pick_io() = 0;
    // Authenticates and serves `socket` (adopted into a TCP socket object) as an accepted TCP connection is.
    virtual void serve_local(asio::ip::tcp::socket socket) = 0;
    // An accept failed for want of a resource (a descriptor limit): the listener pauses, as the TCP one does.
    virtual void local_accept_failed() = 0;
  };

  // Listens on `io` (the main I/O thread) for `host`, unless this host's identity cannot be read or the socket cannot
  // be bound (said in the log as `worker`'s): then address() stays empty and peers on this host dial our TCP port.
  // Once, before accept().
  void start(Host& host, asio::io_context& io, const std::string& worker);
  // Ours, as our Hello and the world table announce it; empty: none.
  const LocalAddress& address() const noexcept { return address_; }
  // Accepts all that are waiting at each wake-up, from now until close(). On the main I/O thread.
  void accept();
  void close();

 private:
  Host* host_ = nullptr;
  std::optional<asio::local::stream_protocol::acceptor> acceptor_;
  LocalAddress address_;
};

}  // namespace corpc::detail
