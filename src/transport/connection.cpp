// TCP and loopback connections: buffered reads that parse every complete frame per system call, large payloads read
// straight into their storage, direct writes from the sending thread, corked gathered writes during dispatch.
#include "transport/connection.hpp"

#include <ATen/ATen.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "memory/cuda_ipc.hpp"
#include "transport/shm_transfer.hpp"
#include "core/trace_recorder.hpp"

namespace corpc::detail {

namespace {

class TcpConnection;

// The dispatch batch of the calling I/O thread: open while it delivers the frames of one read.
struct BatchState {
  asio::io_context* io = nullptr;  // the io_context this thread runs (set by the read loop)
  int open = 0;
  std::vector<std::shared_ptr<TcpConnection>> dirty;
};
thread_local BatchState tls_batch;

void batch_begin(asio::io_context& io) {
  tls_batch.io = &io;
  ++tls_batch.open;
}
void batch_end();

constexpr std::size_t kReadBuffer = 64 * 1024;   // frames whose header, metadata and body fit are parsed in place
constexpr std::size_t kCopyBodyBelow = 4 * 1024; // smaller bodies are copied into the staging buffer
constexpr std::size_t kCommitStep = 1 << 20;     // how far a large body's memory is committed ahead of its bytes
constexpr int kMaxIov = 64;

class TcpConnection final : public Connection {
 public:
  TcpConnection(Transport t, const ConnectionSettings& settings, FrameHandler on_frame, CloseHandler on_close)
      : Connection(static_cast<asio::io_context&>(t.get_executor().context()), settings.make_session),
        transport_(std::move(t)),
        socket_(transport_.socket()),
        settings_(settings), limits_(settings.limits), on_frame_(std::move(on_frame)), on_close_(std::move(on_close)),
        rbuf_(kReadBuffer), room_timer_(io()), liveness_timer_(io()) {
    peer_limits = limits_;
  }

  void release_receive(std::uint64_t bytes) noexcept override {
    received_held_.fetch_sub(bytes);
    settings_.budget->give_back(bytes);  // wakes paused readers, this one included
  }

  void start_reading() {
    asio::error_code ec;
    socket_.set_option(asio::ip::tcp::no_delay(true), ec);
    auto ep = socket_.remote_endpoint(ec);
    if (!ec) remote_address = ep.address().to_string();
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

  void dial(std::string host, std::uint16_t port, AuthConfig auth) {
    asio::co_spawn(socket_.get_executor(), connect(self(), std::move(host), port, std::move(auth)), asio::detached);
  }

  void send(OutFrame&& f) override {
    const std::uint64_t tensor_bytes = f.head.tensor_bytes;
    trace::detail::ScopedRecord slice(
        [&] { return trace::detail::Record{.kind = trace::detail::Kind::tensor_send, .peer = peer_rank, .bytes = tensor_bytes, .name = {}}; },
        tensor_bytes >= trace::kLargeTransferBytes);
    std::unique_lock lock(wmutex_);
    if (closed_) return;
    if (f.lent) f.lent->commit();  // in the wire's order now: out until the peer's IpcDone or this connection's loss
    if (shm_ && tensor_bytes >= kShmMinBytes) shm_send(*shm_, f);  // the data goes through the ring if it has room
    if (!connected_ || flush_owned_ || corked_here() || f.tensors.size() + 3 > kMaxIov || transport_.encrypted()) {
      stage(f, 0);
      schedule_flush();
      return;
    }
    // Nothing queued: write straight from the sending thread.
    iovec iov[kMaxIov];
    int n = 0;
    std::size_t total = 0;
    auto add = [&](const void* p, std::size_t len) {
      if (!len) return;
      iov[n++] = {const_cast<void*>(p), len};
      total += len;
    };
    add(&f.head, sizeof f.head);
    add(f.meta.data(), f.meta.size());
    add(f.body.data(), f.body.size());
    for (auto& t : f.tensors) add(t.data_ptr(), static_cast<std::size_t>(t.nbytes()));
    ssize_t w = write_iov(iov, n);
    if (w == static_cast<ssize_t>(total)) return;
    if (w < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        std::string why = std::string("write failed: ") + std::strerror(errno);
        lock.unlock();
        return close(why);
      }
      w = 0;
    }
    stage(f, static_cast<std::size_t>(w));
    schedule_flush();
  }

  void attach_shm(std::shared_ptr<ShmChannel> channel) override {
    std::lock_guard lock(wmutex_);
    if (!closed_) shm_ = std::move(channel);
  }

  void attach_cuda_ipc(std::shared_ptr<CudaIpcLink> link) override {
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
  std::shared_ptr<CudaIpcLink> cuda_ipc() override {
    std::lock_guard lock(wmutex_);
    return ipc_;
  }
  std::shared_ptr<CudaIpcLink> cuda_ipc_for_lending() override {
    if (!ipc_attached_.load(std::memory_order_acquire)) return nullptr;
    std::lock_guard lock(wmutex_);
    return ipc_ && shm_ && shm_->can_send() && ipc_->lending() ? ipc_ : nullptr;
  }

  void close(std::string why) override {
    asio::post(socket_.get_executor(), [self = self(), why = std::move(why)]() { self->fail(why); });
  }

  void close_when_flushed() override {
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

  // I/O thread: writes what is staged; waits for writability when the socket is full.
  void flush_now() {
    if (transport_.encrypted()) return flush_encrypted();
    std::unique_lock lock(wmutex_);
    if (closed_ || !connected_) return;
    while (seg_i_ < segs_.size()) {
      iovec iov[kMaxIov];
      int n = 0;
      for (std::size_t i = seg_i_; i < segs_.size() && n < kMaxIov; ++i) {
        const Seg& s = segs_[i];
        const char* base = s.ext ? s.ext : stage_.data() + s.off;
        const std::size_t skip = i == seg_i_ ? seg_done_ : 0;
        iov[n++] = {const_cast<char*>(base + skip), s.len - skip};
      }
      ssize_t w = write_iov(iov, n);
      if (w < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          socket_.async_wait(asio::ip::tcp::socket::wait_write, [self = self()](const asio::error_code& ec) {
            if (ec) return self->fail("write failed: " + ec.message());
            self->flush_now();
          });
          return;  // flush_owned_ stays set: the wait owns the flush
        }
        std::string why = std::string("write failed: ") + std::strerror(errno);
        lock.unlock();
        return fail(why);
      }
      advance(static_cast<std::size_t>(w));
      ++written_;  // the peer is taking what we send: a sign of life while it is busy reading a long message
      backlog_.fetch_sub(static_cast<std::size_t>(w), std::memory_order_relaxed);
    }
    flushed(lock);
  }

  // I/O thread, TLS: what is staged goes out through the TLS session in one asynchronous gathered write at a time.
  // The write takes the staged buffers (and the tensors and bodies they point into) with it, so senders keep
  // staging into fresh ones meanwhile; flush_owned_ stays set until nothing is left.
  void flush_encrypted() {
    std::unique_lock lock(wmutex_);
    if (closed_ || !connected_) return;
    if (segs_.empty()) return flushed(lock);
    struct InFlight {
      std::string stage;
      std::vector<Seg> segs;
      std::vector<at::Tensor> tensors;
      std::vector<std::string> bodies;
    };
    auto out = std::make_shared<InFlight>();
    out->stage.swap(stage_);
    out->segs.swap(segs_);
    out->tensors.swap(keep_tensors_);
    out->bodies.swap(keep_bodies_);
    std::vector<asio::const_buffer> buffers;
    buffers.reserve(out->segs.size());
    for (const Seg& seg : out->segs) buffers.emplace_back(seg.ext ? seg.ext : out->stage.data() + seg.off, seg.len);
    lock.unlock();
    asio::async_write(transport_, buffers, WriteProgress{&written_},
                      [self = self(), out](const asio::error_code& ec, std::size_t n) {
                        if (ec) return self->fail("write failed: " + ec.message());
                        self->backlog_.fetch_sub(n, std::memory_order_relaxed);
                        self->flush_encrypted();
                      });
  }

  // Everything staged has been written. wmutex_ held by `lock`.
  void flushed(std::unique_lock<std::mutex>& lock) {
    backlog_.store(0, std::memory_order_relaxed);
    if (paused_) room_timer_.cancel();  // a reader paused for the backlog may go on
    stage_.clear();
    segs_.clear();
    seg_i_ = seg_done_ = 0;
    keep_tensors_.clear();
    keep_bodies_.clear();
    flush_owned_ = false;
    if (close_when_flushed_) {
      lock.unlock();
      fail("closed");
    }
  }

 private:
  struct Seg {
    const char* ext;  // external memory (tensor storage, a large body), or nullptr: stage_ + off
    std::size_t off;
    std::size_t len;
  };

  std::shared_ptr<TcpConnection> self() { return std::static_pointer_cast<TcpConnection>(shared_from_this()); }

  bool corked_here() const noexcept { return tls_batch.open > 0 && tls_batch.io == &const_cast<TcpConnection*>(this)->io(); }

  ssize_t write_iov(iovec* iov, int n) {
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = static_cast<std::size_t>(n);
    ssize_t w;
    do {
      w = ::sendmsg(socket_.native_handle(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (w < 0 && errno == EINTR);
    return w;
  }

  // Appends `f` to the staged output, minus its first `skip` bytes (already written). wmutex_ held.
  void stage(OutFrame& f, std::size_t skip) {
    auto copy = [&](const void* p, std::size_t len) {
      if (skip >= len) return void(skip -= len);
      const char* c = static_cast<const char*>(p) + skip;
      len -= skip;
      skip = 0;
      segs_.push_back({nullptr, stage_.size(), len});
      stage_.append(c, len);
      backlog_.fetch_add(len, std::memory_order_relaxed);
    };
    auto refer = [&](const char* p, std::size_t len) {
      if (skip >= len) return void(skip -= len);
      segs_.push_back({p + skip, 0, len - skip});
      backlog_.fetch_add(len - skip, std::memory_order_relaxed);
      skip = 0;
    };
    copy(&f.head, sizeof f.head);
    copy(f.meta.data(), f.meta.size());
    if (f.body.size() < kCopyBodyBelow) {
      copy(f.body.data(), f.body.size());
    } else {
      keep_bodies_.push_back(std::move(f.body));
      refer(keep_bodies_.back().data(), keep_bodies_.back().size());
    }
    for (auto& t : f.tensors) {
      if (!t.nbytes()) continue;
      refer(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes()));
      keep_tensors_.push_back(std::move(t));
    }
  }

  // Someone must write what was just staged. wmutex_ held.
  void schedule_flush() {
    if (flush_owned_ || !connected_) return;
    flush_owned_ = true;
    if (corked_here()) {
      tls_batch.dirty.push_back(self());
    } else {
      asio::post(socket_.get_executor(), [self = self()] { self->flush_now(); });
    }
  }

  void advance(std::size_t w) {
    while (w && seg_i_ < segs_.size()) {
      const std::size_t left = segs_[seg_i_].len - seg_done_;
      if (w < left) {
        seg_done_ += w;
        return;
      }
      w -= left;
      ++seg_i_;
      seg_done_ = 0;
    }
  }

  static asio::awaitable<void> connect(std::shared_ptr<TcpConnection> self, std::string host, std::uint16_t port,
                                       AuthConfig auth) {
    try {
      asio::ip::tcp::resolver resolver(self->socket_.get_executor());
      auto endpoints = co_await resolver.async_resolve(host, std::to_string(port), asio::use_awaitable);
      co_await asio::async_connect(self->socket_, endpoints, asio::use_awaitable);
      co_await authenticate(self->transport_, auth, AuthRole::dialer);  // queued frames wait for it
    } catch (const std::exception& e) {
      self->fail("cannot connect to " + host + ":" + std::to_string(port) + ": " + e.what());
      co_return;
    }
    if (!self->closed_) self->start_reading();
  }

  // Reads more bytes into the buffer, after flushing the batch of frames delivered so far.
  asio::awaitable<void> read_more() {
    batch_end();
    if (rbeg_ == rend_) {
      rbeg_ = rend_ = 0;
    } else if (rbeg_ > 0) {
      std::memmove(rbuf_.data(), rbuf_.data() + rbeg_, rend_ - rbeg_);
      rend_ -= rbeg_;
      rbeg_ = 0;
    }
    std::size_t n = co_await transport_.async_read_some(asio::buffer(rbuf_.data() + rend_, rbuf_.size() - rend_),
                                                     asio::use_awaitable);
    rend_ += n;
    ++heard_;
  }

  // Moves buffered bytes into `dst` (up to `len`); returns how many.
  std::size_t take_buffered(char* dst, std::size_t len) {
    const std::size_t n = std::min(len, rend_ - rbeg_);
    if (n) std::memcpy(dst, rbuf_.data() + rbeg_, n);  // dst may be null for an empty tensor
    rbeg_ += n;
    return n;
  }

  static asio::awaitable<void> read_loop(std::shared_ptr<TcpConnection> self) {
    try {
      co_await self->read_frames(self);
    } catch (const ProtocolError& e) {
      batch_end();
      self->fail(std::string("protocol error: ") + e.what());
    } catch (const std::system_error& e) {
      batch_end();
      // A TLS peer that closes without a close_notify reads as a truncated stream: our Goodbye frame, not TLS, says
      // whether a close was orderly.
      const bool closed = e.code() == asio::error::eof || e.code() == asio::ssl::error::stream_truncated;
      self->fail(closed ? "connection closed by peer" : e.what());
    } catch (const std::exception& e) {
      batch_end();
      self->fail(e.what());
    }
  }

  asio::awaitable<void> read_frames(std::shared_ptr<Connection> base) {
    for (;;) {
      while (rend_ - rbeg_ < sizeof(FrameHeader)) {
        // A stranger (an HTTP probe, a port scanner) is turned away on its first bytes, not after a header's worth.
        if (rend_ - rbeg_ >= sizeof(kFrameMagic) && std::memcmp(rbuf_.data() + rbeg_, &kFrameMagic, sizeof(kFrameMagic)))
          throw ProtocolError("bad frame magic (not a corpc peer?)");
        co_await read_more();
      }
      Message msg;
      std::memcpy(&msg.head, rbuf_.data() + rbeg_, sizeof(FrameHeader));
      const FrameHeader& h = msg.head;
      validate_header(h, limits_);
      rbeg_ += sizeof(FrameHeader);
      const std::size_t head_len = std::size_t{h.meta_len} + h.body_len;
      ReceiveCredit credit;
      if (h.kind == FrameKind::Request && settings_.budget) {
        // Reserved before anything the header announces is allocated; while there is no room, this connection is
        // not read, so TCP pushes back on its sender.
        const std::uint64_t need = sizeof(FrameHeader) + head_len + h.tensor_bytes;
        if (need > std::min(settings_.budget_per_connection, settings_.budget->bytes_limit())) {
          // The sender checked our announced budget: only a broken peer sends this, and its data is not on the socket.
          if (h.flags & kFlagShm) throw ProtocolError("an oversized request through the same-host channel");
          co_await discard(head_len + h.tensor_bytes);
          if (closed_) co_return;
          if (tls_batch.open == 0) batch_begin(io());
          delivering_refused_ = true;
          on_frame_(base, std::move(msg));
          delivering_refused_ = false;
          continue;
        }
        co_await wait_for_room(need);
        if (closed_) co_return;
        credit = ReceiveCredit(this, need);
      }
      if (h.kind == FrameKind::Ping || h.kind == FrameKind::Pong) {
        if (head_len || h.num_tensors || h.tensor_bytes) throw ProtocolError("a heartbeat with a payload");
        if (h.kind == FrameKind::Ping) send_heartbeat(FrameKind::Pong);
        continue;
      }
      // A large transfer, from its header to its last byte (drawn on this connection's own track: reads of one
      // connection never overlap, while this I/O thread serves others in between).
      const std::int64_t trace_t0 =
          trace::enabled() && h.tensor_bytes >= trace::kLargeTransferBytes ? trace::now_ns() : 0;
      if (head_len <= rbuf_.size()) {
        while (rend_ - rbeg_ < head_len) co_await read_more();
        const char* meta = rbuf_.data() + rbeg_;
        msg.body.assign(meta + h.meta_len, h.body_len);
        if (h.num_tensors || h.meta_len) msg.tensors = decode_tensors(h, meta, h.meta_len, msg);
        rbeg_ += head_len;
      } else {
        // Too large to buffer: straight into its own storage, without a copy through the buffer.
        std::string meta;
        co_await read_growing(meta, h.meta_len);
        co_await read_growing(msg.body, h.body_len);
        msg.tensors = decode_tensors(h, meta.data(), meta.size(), msg);
      }
      if (h.tensor_bytes && !(h.flags & kFlagShm)) {
        std::vector<asio::mutable_buffer> rest;
        for (auto& t : msg.tensors) {
          auto* p = static_cast<char*>(t.data_ptr());
          const auto len = static_cast<std::size_t>(t.nbytes());
          const std::size_t got = take_buffered(p, len);
          if (got < len) rest.emplace_back(p + got, len - got);
        }
        if (!rest.empty()) {
          batch_end();
          co_await asio::async_read(transport_, rest, counting_progress(), asio::use_awaitable);
        }
      }
      if (trace_t0) [[unlikely]] {
        trace::detail::record({.kind = trace::detail::Kind::tensor_receive, .peer = peer_rank, .t0 = trace_t0,
                               .t1 = trace::now_ns(), .bytes = h.tensor_bytes, .name = {}});
      }
      if (h.kind == FrameKind::Goodbye) said_goodbye = true;
      if (closed_) co_return;
      if (tls_batch.open == 0) batch_begin(io());
      delivering_ = &credit;
      try {
        on_frame_(base, std::move(msg));
      } catch (...) {
        delivering_ = nullptr;
        throw;
      }
      delivering_ = nullptr;
    }
  }

  // Reads `len` bytes into `dst` (the buffered ones first, the rest straight from the socket), committing memory only
  // as they arrive: what commits pages is the zero fill of a resize, so `dst` grows by at most kCommitStep ahead of the
  // bytes read. A peer that announces a large frame and sends nothing holds address space, not memory.
  asio::awaitable<void> read_growing(std::string& dst, std::size_t len) {
    dst.reserve(len);  // one allocation, its pages untouched until written
    while (dst.size() < len) {
      const std::size_t at = dst.size();
      dst.resize(std::min(len, at + kCommitStep));
      const std::size_t got = take_buffered(dst.data() + at, dst.size() - at);
      if (at + got == dst.size()) continue;
      batch_end();
      co_await asio::async_read(transport_, asio::buffer(dst.data() + at + got, dst.size() - at - got),
                                counting_progress(), asio::use_awaitable);
    }
  }

  // The frame's tensors: to be read from the socket, or already in the same-host ring; those lent by CUDA IPC are
  // accepted once the link is attached (before the peer could send any).
  std::vector<at::Tensor> decode_tensors(const FrameHeader& h, const char* meta, std::size_t len, Message& msg) {
    if (!ipc_rx_ && ipc_attached_.load(std::memory_order_acquire)) {
      std::lock_guard lock(wmutex_);
      ipc_rx_ = ipc_;
    }
    auto* ipc = ipc_rx_ ? &msg.ipc : nullptr;
    std::vector<at::Tensor> tensors;
    if (!(h.flags & kFlagShm)) {
      tensors = decode_tensor_meta(meta, len, h.num_tensors, h.tensor_bytes, limits_, &msg.devices, ipc);
    } else {
      if (!shm_rx_) {
        std::lock_guard lock(wmutex_);
        shm_rx_ = shm_;
      }
      if (!shm_rx_) throw ProtocolError("tensor data announced in a same-host channel that was never set up");
      tensors = shm_receive(shm_rx_, h, meta, len, limits_, &msg.devices, ipc);
    }
    if (msg.ipc) msg.ipc->link = ipc_rx_;
    return tensors;
  }

  // Reserves `need` bytes of the receive budget, pausing (reading nothing) until there is room and this
  // connection's unsent output is below its bound.
  asio::awaitable<void> wait_for_room(std::uint64_t need) {
    for (;;) {
      const bool backlog_ok = backlog_.load(std::memory_order_relaxed) <= settings_.max_write_backlog;
      if (backlog_ok && try_reserve(need)) co_return;
      batch_end();  // what this thread owes goes out before it waits (the replies among it free room)
      if (backlog_ok) {
        settings_.budget->on_next_give_back([weak = std::weak_ptr(self())] {
          if (auto s = weak.lock()) asio::post(s->io(), [s] { s->room_timer_.cancel(); });
        });
        if (try_reserve(need)) co_return;
      }  // else flush_now wakes us when the backlog has gone
      paused_ = true;
      ++pauses_;
      room_timer_.expires_at(asio::steady_timer::time_point::max());
      asio::error_code ec;
      co_await room_timer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      paused_ = false;
      if (closed_) co_return;
    }
  }

  bool try_reserve(std::uint64_t need) noexcept {
    if (received_held_.load() > settings_.budget_per_connection - need) return false;  // need <= the per-connection budget
    if (!settings_.budget->try_take(need)) return false;
    received_held_.fetch_add(need);
    return true;
  }

  // A completion condition for long reads: each chunk that arrives is a sign of life.
  struct CountingProgress {
    std::uint64_t* heard;
    std::size_t operator()(const asio::error_code& ec, std::size_t) const {
      ++*heard;
      return ec ? 0 : kReadBuffer;
    }
  };
  CountingProgress counting_progress() { return {&heard_}; }
  // The same for TLS writes, per 64 KiB that leaves: a heartbeat alone is no sign, the kernel takes it from us
  // whether the peer is alive or not.
  struct WriteProgress {
    std::uint64_t* written;
    std::size_t counted = 0;
    std::size_t operator()(const asio::error_code& ec, std::size_t total) {
      if (total - counted >= kReadBuffer) {
        ++*written;
        counted = total;
      }
      return ec ? 0 : kReadBuffer;
    }
  };

  void send_heartbeat(FrameKind kind) {
    OutFrame f;
    f.head.kind = kind;
    send(std::move(f));
  }

  // Liveness: every quarter of the timeout, a connection that heard nothing (no bytes in, no progress writing out)
  // since the last check sends a Ping; after four such checks in a row the peer is declared unreachable. A busy
  // connection sends nothing extra; an idle one a 72-byte Ping and Pong per quarter. TCP keepalive would not do:
  // the kernel of a stopped process still answers it.
  static constexpr int kLivenessChecks = 4;
  void schedule_liveness_check() {
    liveness_timer_.expires_after(settings_.liveness_timeout / kLivenessChecks);
    liveness_timer_.async_wait([self = self()](const asio::error_code& ec) {
      if (!ec && !self->closed_) self->check_liveness();
    });
  }
  void check_liveness() {
    // While we do not read (paused for room) we cannot hear the peer: that is our doing, not its silence.
    const bool heard = heard_ != heard_checked_ || written_ != written_checked_ || paused_;
    heard_checked_ = heard_;
    written_checked_ = written_;
    if (heard) {
      silent_checks_ = 0;
    } else if (++silent_checks_ >= kLivenessChecks) {
      return fail("unreachable: no sign of life for " + std::to_string(settings_.liveness_timeout.count()) +
                  " ms (heartbeats unanswered: the process may be stopped or the network cut)");
    }
    // A paused reader pings too, so that the peer keeps hearing from us while we do not read it.
    if (silent_checks_ > 0 || paused_) send_heartbeat(FrameKind::Ping);
    schedule_liveness_check();
  }

  // Reads and drops `n` bytes (a request refused for its size), through the read buffer.
  asio::awaitable<void> discard(std::uint64_t n) {
    for (;;) {
      const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, rend_ - rbeg_));
      rbeg_ += k;
      n -= k;
      if (!n) co_return;
      co_await read_more();
    }
  }

  void fail(const std::string& why) {
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
      ipc = std::move(ipc_);
    }
    // What we lent is released (no IpcDone will come), what we mapped is closed once the copies using it are done.
    if (ipc) ipc->close();
    auto handler = std::move(on_close_);
    on_frame_ = nullptr;
    if (handler) handler(shared_from_this(), why);
  }

  Transport transport_;            // reads go through it (TLS or not); plain writes use the socket directly
  asio::ip::tcp::socket& socket_;  // transport_'s
  const ConnectionSettings settings_;
  WireLimits limits_;
  FrameHandler on_frame_;   // I/O thread
  CloseHandler on_close_;   // I/O thread
  std::vector<char> rbuf_;  // I/O thread
  std::size_t rbeg_ = 0, rend_ = 0;
  asio::steady_timer room_timer_;  // a paused reader waits on it; cancelled when there may be room (I/O thread)
  bool paused_ = false;             // I/O thread
  std::uint64_t pauses_ = 0;        // I/O thread
  std::atomic<std::uint64_t> received_held_{0};  // this connection's share of the receive budget in use
  std::atomic<std::uint64_t> backlog_{0};        // staged bytes not yet written (changed under wmutex_)
  asio::steady_timer liveness_timer_;              // I/O thread, like the counters below
  std::uint64_t heard_ = 0, heard_checked_ = 0;    // reads that brought bytes
  std::uint64_t written_ = 0, written_checked_ = 0;  // staged writes that made progress
  int silent_checks_ = 0;

  std::shared_ptr<ShmChannel> shm_rx_;  // I/O thread: shm_, once a frame needed it
  std::shared_ptr<CudaIpcLink> ipc_rx_;  // I/O thread: ipc_, once attached
  std::atomic<bool> ipc_attached_{false};  // ipc_ was set (spares senders and readers the lock until then)

  std::mutex wmutex_;  // guards everything below, and the socket's descriptor against close while a sender writes
  std::shared_ptr<ShmChannel> shm_;  // the same-host channel, once set up
  std::shared_ptr<CudaIpcLink> ipc_;  // CUDA IPC with the peer, once agreed and attached
  std::string stage_;
  std::vector<Seg> segs_;
  std::size_t seg_i_ = 0, seg_done_ = 0;
  std::vector<at::Tensor> keep_tensors_;
  std::vector<std::string> keep_bodies_;
  bool flush_owned_ = false;  // a flush is due: posted, in the batch's dirty list, or waiting for writability
  bool connected_ = false;
  bool closed_ = false;
  bool close_when_flushed_ = false;

  friend void batch_end();
};

void batch_end() {
  if (tls_batch.open == 0) return;
  tls_batch.open = 0;
  // Flushing may deliver nothing new, but take the list first: a flush never adds to it (the batch is closed).
  for (std::size_t i = 0; i < tls_batch.dirty.size(); ++i) tls_batch.dirty[i]->flush_now();
  tls_batch.dirty.clear();
}

class LoopbackConnection final : public Connection {
 public:
  LoopbackConnection(asio::io_context& io, WireLimits limits, FrameHandler on_frame, const SessionFactory& make_session)
      : Connection(io, make_session), limits_(limits), on_frame_(std::move(on_frame)) {
    peer_limits = limits;
  }

  void send(OutFrame&& f) override {
    // Same semantics as the wire: the receiver gets its own copy of every tensor, detached, requires_grad kept.
    Message msg;
    msg.head = f.head;
    msg.body = std::move(f.body);
    if (f.head.num_tensors) {
      msg.tensors = decode_tensor_meta(f.meta.data(), f.meta.size(), f.head.num_tensors, f.head.tensor_bytes, limits_, &msg.devices);
      for (std::size_t i = 0; i < msg.tensors.size(); ++i)
        if (msg.tensors[i].nbytes())
          std::memcpy(msg.tensors[i].data_ptr(), f.tensors[i].data_ptr(), static_cast<std::size_t>(f.tensors[i].nbytes()));
    }
    asio::post(io(), [self = shared_from_this(), msg = std::move(msg)]() mutable {
      auto* me = static_cast<LoopbackConnection*>(self.get());
      if (!me->on_frame_) return;
      DispatchBatch batch(me->io());
      me->on_frame_(self, std::move(msg));
    });
  }
  void close(std::string) override {
    asio::post(io(), [self = shared_from_this()] { static_cast<LoopbackConnection*>(self.get())->on_frame_ = nullptr; });
  }
  void close_when_flushed() override { close({}); }

 private:
  WireLimits limits_;
  FrameHandler on_frame_;
};

}  // namespace

DispatchBatch::DispatchBatch(asio::io_context& io) { batch_begin(io); }
DispatchBatch::~DispatchBatch() { flush(); }
void DispatchBatch::flush() { batch_end(); }

std::shared_ptr<Connection> make_tcp_connection(Transport transport, const ConnectionSettings& settings,
                                                FrameHandler on_frame, CloseHandler on_close) {
  auto c = std::make_shared<TcpConnection>(std::move(transport), settings, std::move(on_frame), std::move(on_close));
  c->start_reading();
  return c;
}

std::shared_ptr<Connection> dial_tcp_connection(asio::io_context& io, int peer_rank, std::string host,
                                                std::uint16_t port, const ConnectionSettings& settings, FrameHandler on_frame,
                                                CloseHandler on_close, AuthConfig auth) {
  auto c = std::make_shared<TcpConnection>(Transport(asio::ip::tcp::socket(io)), settings, std::move(on_frame), std::move(on_close));
  c->peer_rank = peer_rank;
  c->outgoing = true;
  c->dial(std::move(host), port, std::move(auth));
  return c;
}

std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, WireLimits limits, FrameHandler on_frame,
                                                     const SessionFactory& make_session) {
  return std::make_shared<LoopbackConnection>(io, limits, std::move(on_frame), make_session);
}

}  // namespace corpc::detail
