// One corpc connection: a TCP socket (or an in-process loop back to ourselves) carrying framed messages both ways.
// Private to the runtime.
//
// Threads: each connection belongs to one I/O thread (its io_context), which reads it and delivers every frame to
// the frame handler. Sending is allowed from any thread: a sender writes straight to the socket when nothing is
// queued, so a call from a user thread costs no hand-off. While its I/O thread dispatches the frames of one read,
// sends from that thread are staged and flushed in one gathered write when the batch ends ("corked"), so a burst of
// replies costs one system call.
//
// The TCP connection is tcp_connection.hpp with its tcp_*.cpp; the loopback connection is loopback_connection.cpp.
#pragma once

#include <asio.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "corpc/transport/errors.hpp"

#include "transport/auth.hpp"
#include "transport/frames.hpp"
#include "transport/receive_budget.hpp"

namespace corpc::detail {

class Connection;
class CudaIpcLink;
class ShmChannel;

// What the layer above keeps per connection (the RPC layer: its calls in flight both ways, the direction, whether the
// peer said goodbye or was refused). Made by the creator's
// factory when the connection is, so it is there before the first frame can arrive; destroyed with the connection.
// The transport never looks inside.
class ConnectionSession {
 public:
  virtual ~ConnectionSession() = default;
};
using SessionFactory = std::function<std::unique_ptr<ConnectionSession>(asio::io_context&)>;

// How the runtime's TCP connections behave (from RpcOptions).
struct ConnectionSettings {
  SessionFactory make_session;  // may be empty: no session
  WireLimits limits;
  // Requests' memory: the process-wide budget (owned by the runtime) and this connection's share of it.
  ReceiveBudget* budget = nullptr;  // nullptr: unlimited
  std::uint64_t budget_per_connection = ~std::uint64_t{0};
  // Unsent output beyond which the connection stops reading requests (its peer is not reading our replies).
  std::uint64_t max_write_backlog = ~std::uint64_t{0};
  // Silence after which the peer is declared unreachable; 0: never. Heartbeats are sent while the connection is quiet.
  std::chrono::milliseconds liveness_timeout{0};
};

// The receive-budget reservation of one request: given back when the request has been answered (or dropped).
class ReceiveCredit {
 public:
  ReceiveCredit() = default;
  ReceiveCredit(Connection* conn, std::uint64_t bytes) noexcept : conn_(bytes ? conn : nullptr), bytes_(bytes) {}
  ReceiveCredit(ReceiveCredit&& o) noexcept : conn_(std::exchange(o.conn_, nullptr)), bytes_(o.bytes_) {}
  ReceiveCredit& operator=(ReceiveCredit&& o) noexcept {
    if (this != &o) {
      release();
      conn_ = std::exchange(o.conn_, nullptr);
      bytes_ = o.bytes_;
    }
    return *this;
  }
  ~ReceiveCredit() { release(); }
  inline void release() noexcept;  // the connection must still be alive (its holder keeps a reference)

 private:
  Connection* conn_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// The peer's limits: written on the network thread when its Hello arrives, read by every thread that sends on the
// connection (ThreadSanitizer caught the unguarded version). Reads copy under a lock that is never held for long.
class SharedLimits {
 public:
  explicit SharedLimits(const WireLimits& l = {}) : limits_(l) {}
  SharedLimits& operator=(const WireLimits& l) {
    std::lock_guard lock(mutex_);
    limits_ = l;
    return *this;
  }
  operator WireLimits() const {  // NOLINT: reads like the plain struct it replaces
    std::lock_guard lock(mutex_);
    return limits_;
  }

 private:
  mutable std::mutex mutex_;
  WireLimits limits_;
};
using FrameHandler = std::function<void(const std::shared_ptr<Connection>&, Message&&)>;
using CloseHandler = std::function<void(const std::shared_ptr<Connection>&, const std::string& why)>;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(asio::io_context& io, const SessionFactory& make_session)
      : io_(io), session_(make_session ? make_session(io) : nullptr) {}
  virtual ~Connection() = default;

  // Queues a prepared frame; frames go out in order. Any thread. A frame sent after the connection closed is dropped
  // (the close handler fails whatever waited on it).
  virtual void send(OutFrame&& frame) = 0;
  // Closes now; the close handler runs once with `why`. Any thread.
  virtual void close(std::string why) = 0;
  // Closes once every queued frame is written. Any thread.
  virtual void close_when_flushed() = 0;

  asio::io_context& io() noexcept { return io_; }
  // What this connection's handshake established that no other connection shares (stream.hpp's SessionKeys); empty
  // for a connection that had none. Fixed once frames flow.
  virtual std::string handshake_transcript() const { return {}; }
  // Until release_sends(), frames sent are queued behind those sent before hold_sends() (a dialer's Hello): the peer
  // sees nothing more of ours until its answer has proved who it is. Any thread; ignored where there is no peer.
  virtual void hold_sends() {}
  virtual void release_sends() {}
  // The upper layer's state (ConnectionSettings::make_session); null if none was asked for.
  ConnectionSession* session() const noexcept { return session_.get(); }

  // While the frame handler runs for a request: its receive-budget reservation. A handler that keeps the request
  // past its return (a pooled or asynchronous function) takes the credit and releases it once the request is
  // answered; otherwise it is given back when the handler returns.
  ReceiveCredit take_receive_credit() noexcept { return delivering_ ? std::move(*delivering_) : ReceiveCredit{}; }
  // True while the frame handler runs for a request refused for its size: only its header was kept (its bytes were
  // read and dropped), and the handler answers it with MessageTooLargeError.
  bool delivering_refused() const noexcept { return delivering_refused_; }
  // Gives back a request's reservation. Any thread.
  virtual void release_receive(std::uint64_t) noexcept {}
  // From now on, the tensor data of large messages may travel through this same-host channel (src/transport/shm_channel.hpp)
  // in both directions. Any thread; ignored by connections that have no use for one.
  virtual void attach_shm(std::shared_ptr<ShmChannel>) {}
  // Runs `set_up` once, the first time a message with kShmMinBytes of tensor data or more is sent, or arrives by TCP,
  // while no channel is attached: a channel is then set up only between peers that exchange large tensors. `set_up`
  // runs on the thread that sends or reads, with no lock of the connection held; it must not block. Any thread;
  // ignored by connections that have no use for a channel.
  virtual void set_up_shm_when_needed(std::function<void()>) {}
  // CUDA IPC with the peer (src/memory/cuda_ipc.hpp), agreed in the handshake: attached just before the same-host channel
  // (whose set-up is what lets the peer send), and closed with the connection. Any thread; ignored by connections
  // that have no use for one.
  virtual void attach_cuda_ipc(std::shared_ptr<CudaIpcLink>) {}
  // The link, once attached (the IpcDone frames it receives return its loans). Any thread.
  virtual std::shared_ptr<CudaIpcLink> cuda_ipc() { return nullptr; }
  // The link if CUDA tensors may be lent on this connection now: attached, the same-host channel sends (so the peer
  // has its link too), lending not refused. Any thread.
  virtual std::shared_ptr<CudaIpcLink> cuda_ipc_for_lending() { return nullptr; }

  int peer_rank = -1;          // known after the Hello (or at once for dialed connections); I/O thread
  std::string remote_address;  // the peer's IP as we see it
  SharedLimits peer_limits;    // what the peer accepts (from its Hello; ours until then)

 protected:
  ReceiveCredit* delivering_ = nullptr;  // I/O thread
  bool delivering_refused_ = false;      // I/O thread

 private:
  asio::io_context& io_;
  std::unique_ptr<ConnectionSession> session_;
};

void ReceiveCredit::release() noexcept {
  if (conn_) std::exchange(conn_, nullptr)->release_receive(bytes_);
}

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

// A TCP connection over an authenticated transport (plain or TLS); it starts reading at once. Frames and the close
// reach the handlers on the network thread. `remote_address`: the peer's IP when the caller knows it already (an
// acceptor learns it from accept); empty, it is asked of the socket.
std::shared_ptr<Connection> make_tcp_connection(Transport transport, const ConnectionSettings& settings,
                                                FrameHandler on_frame, CloseHandler on_close,
                                                std::string remote_address = {});

// The first frame a dialer sends, made for the connection's handshake transcript (SessionKeys::transcript) once the
// handshake is done, on the connection's I/O thread.
using FirstFrame = std::function<OutFrame(const std::string& transcript)>;

// Dials host:port and authenticates (TLS and the secret, as `auth` says); queued frames wait for both. A failure to
// connect or authenticate closes it with the reason. `local_socket`, if not empty, names the peer's abstract Unix
// socket (without the leading NUL): tried first, on every attempt, with TCP when it cannot be connected to.
// `peer_rank` is set before dialing starts, so that a connect that fails at once is still attributed to its peer.
// With `first`, that frame goes out first and every frame sent before release_sends() is held.
std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, std::string local_socket,
                                                const ConnectionSettings& settings, FrameHandler on_frame,
                                                CloseHandler on_close, AuthConfig auth, FirstFrame first = {});

// Calls to ourselves: each frame comes back to `on_frame` as if received, through a copy of its tensors, so that a
// self-call has exactly the semantics of a remote one.
std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, WireLimits limits, FrameHandler on_frame,
                                                     const SessionFactory& make_session);

}  // namespace corpc::detail
