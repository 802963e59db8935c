// One corpc connection: a TCP socket (or an in-process loop back to ourselves) carrying framed messages both ways.
// Private to the runtime.
//
// Threads: each connection belongs to one I/O thread (its io_context), which reads it and delivers every frame to
// the frame handler. Sending is allowed from any thread: a sender writes straight to the socket when nothing is
// queued, so a call from a user thread costs no hand-off. While its I/O thread dispatches the frames of one read,
// sends from that thread are staged and flushed in one gathered write when the batch ends ("corked"), so a burst of
// replies costs one system call.
#pragma once

#include "auth.hpp"
#include <asio.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "corpc/wire/message.hpp"
#include "inbound_calls.hpp"
#include "pending_calls.hpp"

namespace corpc::detail {

class Connection;
using FrameHandler = std::function<void(const std::shared_ptr<Connection>&, Message&&)>;
using CloseHandler = std::function<void(const std::shared_ptr<Connection>&, const std::string& why)>;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  explicit Connection(asio::io_context& io) : deadline_timer(io), io_(io) {}
  virtual ~Connection() = default;

  // Queues a prepared frame; frames go out in order. Any thread. A frame sent after the connection closed is dropped
  // (the close handler fails whatever waited on it).
  virtual void send(OutFrame&& frame) = 0;
  // Closes now; the close handler runs once with `why`. Any thread.
  virtual void close(std::string why) = 0;
  // Closes once every queued frame is written. Any thread.
  virtual void close_when_flushed() = 0;

  asio::io_context& io() noexcept { return io_; }

  int peer_rank = -1;          // known after the Hello (or at once for dialed connections); I/O thread
  bool said_goodbye = false;   // the peer announced an orderly close
  bool outgoing = false;       // we dialed it: our requests to peer_rank go here, and only its replies are accepted
  std::string remote_address;  // the peer's IP as we see it
  WireLimits peer_limits;      // what the peer accepts (from its Hello; ours until then)

  // Our requests on this connection awaiting replies, and the timer armed for the earliest deadline among them.
  PendingCalls pending;
  asio::steady_timer deadline_timer;                                 // I/O thread
  std::atomic<Clock::time_point> timer_armed_for{Clock::time_point::max()};  // written on the I/O thread
  // The peer's requests running here that a cancel frame can still stop.
  InboundCalls inbound;

 private:
  asio::io_context& io_;
};

// Flushes, at the end of the current dispatch batch, every connection that was written to during it. Installed by
// the read loop around the delivery of the frames of one read.
class DispatchBatch {
 public:
  explicit DispatchBatch(asio::io_context& io);
  ~DispatchBatch();
  DispatchBatch(const DispatchBatch&) = delete;
  DispatchBatch& operator=(const DispatchBatch&) = delete;
  void flush();
};

// A TCP connection. `start` begins reading; frames and the close reach the handlers on the network thread.
std::shared_ptr<Connection> make_tcp_connection(asio::ip::tcp::socket socket, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close);

// Dials host:port; queued frames wait for the connection. A failure to connect closes it with the reason.
// `peer_rank` is set before dialing starts, so that a connect that fails at once is still attributed to its peer.
std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, WireLimits limits, FrameHandler on_frame,
                                                CloseHandler on_close, AuthConfig auth);

// Calls to ourselves: each frame comes back to `on_frame` as if received, through a copy of its tensors, so that a
// self-call has exactly the semantics of a remote one.
std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, WireLimits limits, FrameHandler on_frame);

}  // namespace corpc::detail
