// A TCP connection's life outside its reads and writes: made from an accepted (and authenticated) transport, it
// starts reading at once; the same-host channel and CUDA IPC are attached to it once the handshake agrees on them;
// it closes once, on the I/O thread, whoever asks. The parts: tcp_connection.hpp.
#include "transport/tcp_connection.hpp"

#include "memory/cuda_ipc.hpp"
#include "transport/shm_channel.hpp"

namespace corpc::detail {

TcpConnection::TcpConnection(Transport t, const ConnectionSettings& settings, FrameHandler on_frame,
                             CloseHandler on_close)
    : Connection(static_cast<asio::io_context&>(t.get_executor().context()), settings.make_session),
      transport_(std::move(t)),
      socket_(transport_.socket()),
      settings_(settings),
      limits_(settings.limits),
      on_frame_(std::move(on_frame)),
      on_close_(std::move(on_close)),
      rbuf_(std::make_unique_for_overwrite<char[]>(kFirstReadBuffer)),
      room_timer_(io()),
      liveness_timer_(io()) {
  peer_limits = limits_;
  install_seals();  // an accepted transport is authenticated already; a dialed one installs them in connect()
}

void TcpConnection::install_seals() {
  const SessionKeys& keys = transport_.session_keys();
  if (keys.send_key.empty()) return;
  auto out = std::make_unique<FrameSeal>(keys.send_key);
  seal_in_ = std::make_unique<FrameSeal>(keys.receive_key);
  std::lock_guard lock(wmutex_);
  seal_out_ = std::move(out);
}

void TcpConnection::start_reading() {
  asio::error_code ec;
  socket_.set_option(asio::ip::tcp::no_delay(true), ec);
  if (remote_address.empty()) {  // the runtime always passes it (accepted or dialed); a system call saved per connection
    auto ep = socket_.remote_endpoint(ec);
    if (!ec) remote_address = ep.address().to_string();
  }
  asio::co_spawn(socket_.get_executor(), read_loop(self()), asio::detached);
  {
    std::lock_guard lock(wmutex_);
    connected_ = true;
    // What was queued while dialing (the Hello first) must reach the socket before anything a sender writes
    // directly: this thread owns the flush until it is done, so senders stage behind it. (Without this, a call
    // made between here and flush_now() went out ahead of the Hello: "a request before hello" at the peer.)
    flush_owned_ = true;
  }
  flush_now();
  if (settings_.liveness_timeout.count() > 0) schedule_liveness_check();
}

void TcpConnection::attach_shm(std::shared_ptr<ShmChannel> channel) {
  std::lock_guard lock(wmutex_);
  if (closed_) return;
  shm_ = std::move(channel);
  shm_wanted_ = nullptr;
  shm_wanted_set_.store(false, std::memory_order_relaxed);
}

void TcpConnection::set_up_shm_when_needed(std::function<void()> set_up) {
  std::lock_guard lock(wmutex_);
  if (closed_ || shm_) return;
  shm_wanted_ = std::move(set_up);
  shm_wanted_set_.store(true, std::memory_order_release);
}

std::function<void()> TcpConnection::take_shm_set_up() {
  if (!shm_wanted_set_.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard lock(wmutex_);
  shm_wanted_set_.store(false, std::memory_order_relaxed);
  return std::exchange(shm_wanted_, nullptr);
}

void TcpConnection::attach_cuda_ipc(std::shared_ptr<CudaIpcLink> link) {
  {
    std::lock_guard lock(wmutex_);
    if (!closed_) {
      ipc_ = std::move(link);
      ipc_attached_.store(true, std::memory_order_release);
      return;
    }
  }
  link->close();
}
std::shared_ptr<CudaIpcLink> TcpConnection::cuda_ipc() {
  std::lock_guard lock(wmutex_);
  return ipc_;
}
std::shared_ptr<CudaIpcLink> TcpConnection::cuda_ipc_for_lending() {
  if (!ipc_attached_.load(std::memory_order_acquire)) return nullptr;
  std::lock_guard lock(wmutex_);
  return ipc_ && shm_ && shm_->can_send() && ipc_->lending() ? ipc_ : nullptr;
}

void TcpConnection::close(std::string why) {
  asio::post(socket_.get_executor(), [self = self(), why = std::move(why)]() { self->fail(why); });
}

void TcpConnection::close_when_flushed() {
  asio::post(socket_.get_executor(), [self = self()]() {
    bool now;
    {
      std::lock_guard lock(self->wmutex_);
      self->close_when_flushed_ = true;
      now = !self->flush_owned_ || !self->connected_;
    }
    if (now) self->fail("closed");
  });
}

void TcpConnection::fail(const std::string& why) {
  room_timer_.cancel();  // a reader paused for room ends
  liveness_timer_.cancel();
  std::shared_ptr<CudaIpcLink> ipc;
  {
    std::lock_guard lock(wmutex_);
    if (closed_) return;
    closed_ = true;  // before the socket closes: no sender may touch its descriptor after this
    asio::error_code ec;
    socket_.shutdown(asio::ip::tcp::socket::shutdown_both, ec);
    socket_.close(ec);
    keep_tensors_.clear();
    keep_bodies_.clear();
    segs_.clear();
    shm_.reset();  // its mapping goes once the tensors received through it are freed too
    shm_wanted_ = nullptr;
    shm_wanted_set_.store(false, std::memory_order_relaxed);
    ipc = std::move(ipc_);
  }
  // What we lent is released (no IpcDone will come), what we mapped is closed once the copies using it are done.
  if (ipc) ipc->close();
  auto handler = std::move(on_close_);
  on_frame_ = nullptr;
  if (handler) handler(shared_from_this(), why);
}

std::shared_ptr<Connection> make_tcp_connection(Transport transport, const ConnectionSettings& settings,
                                                FrameHandler on_frame, CloseHandler on_close,
                                                std::string remote_address) {
  auto c = std::make_shared<TcpConnection>(std::move(transport), settings, std::move(on_frame), std::move(on_close));
  c->remote_address = std::move(remote_address);
  c->start_reading();
  return c;
}

}  // namespace corpc::detail
