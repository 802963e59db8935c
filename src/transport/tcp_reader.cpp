// The reading side of a TCP connection, on its I/O thread: buffered reads that parse every complete frame per system
// call, large metadata and bodies read straight into their own storage (memory committed as the bytes arrive),
// tensor data straight into the tensors. Frames reach the frame handler inside the thread's dispatch batch, which is
// flushed before every read that may wait.
#include <cstring>

#include "core/trace_recorder.hpp"
#include "memory/cuda_ipc.hpp"
#include "transport/shm_transfer.hpp"
#include "transport/tcp_connection.hpp"

namespace corpc::detail {

asio::awaitable<void> TcpConnection::read_loop(std::shared_ptr<TcpConnection> self) {
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

// One coroutine, although long: its helpers that wait (read_more, discard, check_seal) run only when the buffer runs dry
// or for rare frames, while a helper coroutine for the common steps (the header, the payload) would allocate a frame
// of its own for every message read.
asio::awaitable<void> TcpConnection::read_frames(std::shared_ptr<Connection> base) {
  for (;;) {
    while (rend_ - rbeg_ < sizeof(FrameHeader)) {
      // A stranger (an HTTP probe, a port scanner) is turned away on its first bytes, not after a header's worth.
      if (rend_ - rbeg_ >= sizeof(kFrameMagic) && std::memcmp(rbuf_.get() + rbeg_, &kFrameMagic, sizeof(kFrameMagic)))
        throw ProtocolError("bad frame magic (not a corpc peer?)");
      co_await read_more();
    }
    Message msg;
    std::memcpy(&msg.head, rbuf_.get() + rbeg_, sizeof(FrameHeader));
    const FrameHeader& h = msg.head;
    validate_header(h, limits_);
    // Every byte of the frame goes into its tag as it is taken; the frame is acted on only once the tag matches.
    FrameSeal* const seal = seal_in_.get();
    if (seal) {
      seal->begin();
      seal->add(rbuf_.get() + rbeg_, sizeof(FrameHeader));
    }
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
        if (seal) co_await check_seal();
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
      if (seal) co_await check_seal();
      if (h.kind == FrameKind::Ping) send_heartbeat(FrameKind::Pong);
      continue;
    }
    // A large transfer, from its header to its last byte (drawn on this connection's own track: reads of one
    // connection never overlap, while this I/O thread serves others in between).
    const std::int64_t trace_t0 =
        trace::enabled() && h.tensor_bytes >= trace::kLargeTransferBytes ? trace::now_ns() : 0;
    const bool socket_data = h.tensor_bytes && !(h.flags & kFlagShm);
    // A sealed frame with no tensor data on the socket has its tag right behind: checked before its metadata is acted
    // on (a same-host ring's offsets, CUDA IPC handles) when both fit in the buffer.
    const std::size_t tag_len = seal && !socket_data ? FrameSeal::kTagBytes : 0;
    bool tag_checked = false;
    if (head_len + tag_len <= kReadBuffer) {
      while (rend_ - rbeg_ < head_len + tag_len) co_await read_more();
      const char* meta = rbuf_.get() + rbeg_;
      if (seal) seal->add(meta, head_len);
      if (tag_len) {
        if (!seal->matches(reinterpret_cast<const unsigned char*>(meta + head_len))) throw_seal_mismatch();
        tag_checked = true;
      }
      msg.body.assign(meta + h.meta_len, h.body_len);
      if (h.num_tensors || h.meta_len) msg.tensors = decode_tensors(h, meta, h.meta_len, msg);
      rbeg_ += head_len + tag_len;
    } else {
      // Too large to buffer: straight into its own storage, without a copy through the buffer.
      std::string meta;
      co_await read_growing(meta, h.meta_len);
      co_await read_growing(msg.body, h.body_len);
      if (seal) {
        seal->add(meta.data(), meta.size());
        seal->add(msg.body.data(), msg.body.size());
      }
      msg.tensors = decode_tensors(h, meta.data(), meta.size(), msg);
    }
    if (socket_data) {
      // The peer cannot set a channel up (only the dialer can): a large message from it asks for one here.
      if (h.tensor_bytes >= kShmMinBytes && !shm_rx_) {
        if (auto set_up = take_shm_set_up()) set_up();
      }
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
      if (seal)
        for (const auto& t : msg.tensors) seal->add(t.data_ptr(), static_cast<std::size_t>(t.nbytes()));
    }
    if (seal && !tag_checked) co_await check_seal();
    if (trace_t0) [[unlikely]] {
      trace::detail::record({.kind = trace::detail::Kind::tensor_receive,
                             .peer = peer_rank,
                             .t0 = trace_t0,
                             .t1 = trace::now_ns(),
                             .bytes = h.tensor_bytes,
                             .name = {}});
    }
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

// Reads more bytes into the buffer, after flushing the batch of frames delivered so far.
asio::awaitable<void> TcpConnection::read_more() {
  batch_end();
  if (rbeg_ == rend_) {
    rbeg_ = rend_ = 0;
  } else if (rbeg_ > 0) {
    std::memmove(rbuf_.get(), rbuf_.get() + rbeg_, rend_ - rbeg_);
    rend_ -= rbeg_;
    rbeg_ = 0;
  }
  if (rend_ == rbuf_size_) grow_read_buffer();  // a frame's head larger than the first buffer
  std::size_t n =
      co_await transport_.async_read_some(asio::buffer(rbuf_.get() + rend_, rbuf_size_ - rend_), asio::use_awaitable);
  rend_ += n;
  ++heard_;
  if (rend_ == rbuf_size_) grow_read_buffer();  // a full read: more is coming, a burst of frames or a larger one
}

void TcpConnection::grow_read_buffer() {
  if (rbuf_size_ == kReadBuffer) return;
  auto bigger = std::make_unique_for_overwrite<char[]>(kReadBuffer);
  std::memcpy(bigger.get(), rbuf_.get() + rbeg_, rend_ - rbeg_);
  rend_ -= rbeg_;
  rbeg_ = 0;
  rbuf_ = std::move(bigger);
  rbuf_size_ = kReadBuffer;
}

// Moves buffered bytes into `dst` (up to `len`); returns how many.
std::size_t TcpConnection::take_buffered(char* dst, std::size_t len) {
  const std::size_t n = std::min(len, rend_ - rbeg_);
  if (n) std::memcpy(dst, rbuf_.get() + rbeg_, n);  // dst may be null for an empty tensor
  rbeg_ += n;
  return n;
}

// Reads `len` bytes into `dst` (the buffered ones first, the rest straight from the socket), committing memory only
// as they arrive: what commits pages is the zero fill of a resize, so `dst` grows by at most kCommitStep ahead of the
// bytes read. A peer that announces a large frame and sends nothing holds address space, not memory.
asio::awaitable<void> TcpConnection::read_growing(std::string& dst, std::size_t len) {
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
std::vector<at::Tensor> TcpConnection::decode_tensors(const FrameHeader& h, const char* meta, std::size_t len,
                                                      Message& msg) {
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

// Reads the tag that follows a sealed frame and checks it against what the frame brought: a frame that was altered,
// replayed, reordered or made by someone without this connection's key ends the connection before it is acted on.
asio::awaitable<void> TcpConnection::check_seal() {
  while (rend_ - rbeg_ < FrameSeal::kTagBytes) co_await read_more();
  if (!seal_in_->matches(reinterpret_cast<const unsigned char*>(rbuf_.get() + rbeg_))) throw_seal_mismatch();
  rbeg_ += FrameSeal::kTagBytes;
}

void TcpConnection::throw_seal_mismatch() {
  throw ProtocolError(
      "a frame failed its integrity check (changed on the way, or not sent by the peer that authenticated)");
}

// Reads and drops `n` bytes (a request refused for its size), through the read buffer; they still count for the tag.
asio::awaitable<void> TcpConnection::discard(std::uint64_t n) {
  for (;;) {
    const std::size_t k = static_cast<std::size_t>(std::min<std::uint64_t>(n, rend_ - rbeg_));
    if (seal_in_) seal_in_->add(rbuf_.get() + rbeg_, k);
    rbeg_ += k;
    n -= k;
    if (!n) co_return;
    co_await read_more();
  }
}

}  // namespace corpc::detail
