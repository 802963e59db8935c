// One corpc connection: a TCP socket (or an in-process loop back to ourselves) carrying framed messages both ways.
// Private to the runtime. Every method is called on the runtime's single network thread unless it says otherwise.
#pragma once

#include <asio.hpp>

#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "corpc/wire/message.hpp"

namespace corpc::detail {

class Connection;
using FrameHandler = std::function<void(const std::shared_ptr<Connection>&, Message&&)>;
using CloseHandler = std::function<void(const std::shared_ptr<Connection>&, const std::string& why)>;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  virtual ~Connection() = default;

  // Queues a message; frames go out in order. Any thread: the frame is prepared here and handed to the network thread.
  virtual void send(Message msg) = 0;
  // Closes now; the close handler runs once with `why`. Any thread.
  virtual void close(std::string why) = 0;
  // Closes once every queued frame is written. Any thread.
  virtual void close_when_flushed() = 0;

  int peer_rank = -1;          // known after the Hello (or at once for dialed connections)
  bool said_goodbye = false;   // the peer announced an orderly close
  bool outgoing = false;       // we dialed it: our requests to peer_rank go here
  std::string remote_address;  // the peer's IP as we see it
};

// A TCP connection. `start` begins reading; frames and the close reach the handlers on the network thread.
std::shared_ptr<Connection> make_tcp_connection(asio::ip::tcp::socket socket, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close);

// Dials host:port; queued frames wait for the connection. A failure to connect closes it with the reason.
// `peer_rank` is set before dialing starts, so that a connect that fails at once is still attributed to its peer.
std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close);

// Calls to ourselves: each frame comes back to `on_frame` as if received, through a copy of its tensors, so that a
// self-call has exactly the semantics of a remote one.
std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, FrameHandler on_frame);

}  // namespace corpc::detail
