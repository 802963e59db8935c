// The writing side of a TCP connection. Frames are staged (small parts copied, tensors and large bodies referred to)
// and whoever owns the flush writes them in one gathered write:
// - an I/O thread delivering the frames of one read stages its sends and flushes them when the batch ends ("corked"),
//   so a burst of replies costs one system call;
// - any other thread (a caller, a worker-pool job) writes the first frame it sends after it last blocked or ended a
//   job straight from its own thread, when nothing is queued on that connection; it stages the frames that follow and
//   writes them itself just before it blocks or when its job ends (core's deferred work), so calls issued back to
//   back (a loop of rpc_async, a coroutine fanning out) leave together; a flush posted to the I/O thread is the
//   fallback for a thread that does neither. Only what is already queued is coalesced: nothing waits for more;
// - rpc_sync's request (the caller blocks right after it) is written straight from the sending thread too.
// TLS writes always go through the I/O thread.
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "corpc/core/detail/deferred_work.hpp"
#include "corpc/core/executor.hpp"

#include "core/trace_recorder.hpp"
#include "memory/cuda_ipc.hpp"
#include "transport/shm_transfer.hpp"
#include "transport/tcp_connection.hpp"

namespace corpc::detail {

thread_local constinit BatchState tls_batch;

namespace {
// The connections written to during the calling thread's open batch, flushed when it ends.
thread_local std::vector<std::shared_ptr<TcpConnection>> batch_dirty;
// The connections a thread outside the I/O threads staged frames on, written before it blocks or ends its job. Weak:
// a thread that never blocks again (a program's main thread after shutdown) must not keep a connection past its
// runtime, to be destroyed at thread exit after the I/O threads are gone; its frames leave by the posted flush.
thread_local std::vector<std::weak_ptr<TcpConnection>> sender_dirty;
// Frames the calling thread (outside the I/O threads) sent since it last blocked or ended a job: its sender batch.
thread_local int sender_batch_frames = 0;

void flush_sender_batches() noexcept {
  sender_batch_frames = 0;
  auto dirty = std::move(sender_dirty);
  sender_dirty.clear();
  for (auto& weak : dirty)
    if (auto c = weak.lock()) c->flush_from_sender();
}

const bool g_deferred_registered = (set_deferred_work(&flush_sender_batches), true);

// A sender writes what it has staged at once past this much (its staging must not grow without bound).
constexpr std::size_t kSenderBatchBytes = 256 * 1024;
}  // namespace

void flush_batch() {
  // Flushing may deliver nothing new, but take the list first: a flush never adds to it (the batch is closed).
  for (std::size_t i = 0; i < batch_dirty.size(); ++i) batch_dirty[i]->flush_now();
  batch_dirty.clear();
}

DispatchBatch::DispatchBatch(asio::io_context& io) { batch_begin(io); }
DispatchBatch::~DispatchBatch() { flush(); }
void DispatchBatch::flush() { batch_end(); }

void TcpConnection::send(OutFrame&& f) { send_frame(std::move(f), false); }

void TcpConnection::hold_sends() {
  std::lock_guard lock(wmutex_);
  holding_ = true;
}

// The held frames go out in the order they were sent; frames sent meanwhile queue behind them until none is left.
void TcpConnection::release_sends() {
  for (;;) {
    std::vector<OutFrame> frames;
    {
      std::lock_guard lock(wmutex_);
      if (held_.empty()) {
        holding_ = false;
        return;
      }
      frames.swap(held_);
    }
    for (auto& f : frames) send_frame(std::move(f), true);
  }
}

void TcpConnection::send_frame(OutFrame&& f, bool released) {
  const std::uint64_t tensor_bytes = f.head.tensor_bytes;
  trace::detail::ScopedRecord slice(
      [&] {
        return trace::detail::Record{
            .kind = trace::detail::Kind::tensor_send, .peer = peer_rank, .bytes = tensor_bytes, .name = {}};
      },
      tensor_bytes >= trace::kLargeTransferBytes);
  // A channel's set-up that this message calls for starts once the write lock is released (declared before it).
  struct SetUpAfter {
    std::function<void()> fn;
    ~SetUpAfter() {
      if (fn) fn();
    }
  } shm_set_up;
  std::unique_lock lock(wmutex_);
  if (closed_) return;
  if (holding_ && !released) return held_.push_back(std::move(f));
  if (f.lent) f.lent->commit();  // in the wire's order now: out until the peer's IpcDone or this connection's loss
  if (tensor_bytes >= kShmMinBytes) {
    if (shm_) shm_send(*shm_, f);  // the data goes through the ring if it has room
    else if (shm_wanted_) {
      shm_set_up.fn = std::exchange(shm_wanted_, nullptr);
      shm_wanted_set_.store(false, std::memory_order_relaxed);
    }
  }
  // A thread outside the I/O threads coalesces the frames of its sender batch after the first, unless it blocks on
  // this very frame next (rpc_sync). The first leaves at once: a job that sends one frame (a reply, a coroutine's
  // next call) then gains nothing by waiting, and staging it would cost a wake-up of the I/O thread for the posted
  // flush, the fallback that staged frames need. Whether TLS is on is read only once connected: until then the
  // dial's I/O thread is setting it up (and nothing is written anyway).
  FrameSeal::Tag tag;
  const FrameSeal::Tag* sealed = seal_outgoing(f, tag);
  bool coalesce = false;
  if (tls_batch.io == nullptr && connected_ && !transport_.encrypted()) {
    coalesce = !f.send_now && sender_batch_frames > 0;
    if (sender_batch_frames++ == 0) defer_work();  // the batch ends when this thread blocks or ends its job
  }
  if (!connected_ || flush_owned_ || corked_here() || f.tensors.size() + 4 > kMaxIov || transport_.encrypted() ||
      coalesce) {
    stage(f, 0, sealed);
    // This thread writes it before it blocks (its batch's first frame armed that); the flush posted to the I/O
    // thread covers a thread that never does.
    if (coalesce && !flush_owned_) sender_dirty.push_back(self());
    schedule_flush();
    if (coalesce && backlog_.load(std::memory_order_relaxed) >= kSenderBatchBytes) {
      lock.unlock();
      flush_from_sender();
    }
    return;
  }
  write_now(f, sealed, lock);
}

// The frame's tag, over exactly what goes on the socket (the tensors that went into the ring do not), taken in the
// order frames are written: under the write lock, as the frame is written or staged.
const FrameSeal::Tag* TcpConnection::seal_outgoing(const OutFrame& f, FrameSeal::Tag& tag) {
  if (!seal_out_) return nullptr;
  seal_out_->begin();
  seal_out_->add(&f.head, sizeof f.head);
  seal_out_->add(f.meta.data(), f.meta.size());
  seal_out_->add(f.body.data(), f.body.size());
  for (const auto& t : f.tensors) seal_out_->add(t.data_ptr(), static_cast<std::size_t>(t.nbytes()));
  tag = seal_out_->tag();
  return &tag;
}

// Nothing queued: straight from the sending thread.
void TcpConnection::write_now(OutFrame& f, const FrameSeal::Tag* sealed, std::unique_lock<std::mutex>& lock) {
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
  if (sealed) add(sealed->data(), sealed->size());
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
  stage(f, static_cast<std::size_t>(w), sealed);
  schedule_flush();
}

ssize_t TcpConnection::write_iov(iovec* iov, int n) {
  msghdr mh{};
  mh.msg_iov = iov;
  mh.msg_iovlen = static_cast<std::size_t>(n);
  ssize_t w;
  do {
    w = ::sendmsg(socket_.native_handle(), &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (w < 0 && errno == EINTR);
  return w;
}

// Appends `f` (and its tag, if sealed) to the staged output, minus its first `skip` bytes (already written). wmutex_
// held.
void TcpConnection::stage(OutFrame& f, std::size_t skip, const FrameSeal::Tag* tag) {
  auto copy = [&](const void* p, std::size_t len) {
    if (skip >= len) return void(skip -= len);
    const char* c = static_cast<const char*>(p) + skip;
    len -= skip;
    skip = 0;
    // Copies that follow each other in the staging buffer are one segment: coalesced small frames fill one iovec.
    if (!segs_.empty() && segs_.back().ext == nullptr && segs_.back().off + segs_.back().len == stage_.size() &&
        seg_i_ < segs_.size()) {
      segs_.back().len += len;
    } else {
      segs_.push_back({nullptr, stage_.size(), len});
    }
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
  if (tag) copy(tag->data(), tag->size());
}

// Puts `bytes` ahead of every staged frame (the handshake's last message, while dialing: nothing is written yet).
void TcpConnection::stage_first(const std::string& bytes) {
  if (bytes.empty()) return;
  std::lock_guard lock(wmutex_);
  for (Seg& s : segs_)
    if (!s.ext) s.off += bytes.size();
  stage_.insert(0, bytes);
  segs_.insert(segs_.begin(), Seg{nullptr, 0, bytes.size()});
  backlog_.fetch_add(bytes.size(), std::memory_order_relaxed);
}

// Someone must write what was just staged. wmutex_ held.
void TcpConnection::schedule_flush() {
  if (flush_owned_ || !connected_) return;
  flush_owned_ = true;
  if (corked_here()) {
    batch_dirty.push_back(self());
  } else {
    asio::post(socket_.get_executor(), [self = self()] { self->flush_now(); });
  }
}

// I/O thread: writes what is staged; waits for writability when the socket is full.
void TcpConnection::flush_now() {
  if (transport_.encrypted()) return flush_encrypted();
  std::unique_lock lock(wmutex_);
  if (closed_ || !connected_) return;
  while (seg_i_ < segs_.size()) {
    iovec iov[kMaxIov];
    ssize_t w = write_iov(iov, gather_staged(iov));
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

// A sender's thread, before it blocks or when its job ends: writes what is staged. If the socket is full or the write
// fails, what is left is the I/O thread's, whose flush was posted when the first frame was staged (and which reports
// a failure on its own thread). The socket is only written here, never waited on: waits belong to the I/O thread.
void TcpConnection::flush_from_sender() noexcept {
  std::unique_lock lock(wmutex_);
  if (closed_ || !connected_ || !flush_owned_ || transport_.encrypted()) return;
  while (seg_i_ < segs_.size()) {
    iovec iov[kMaxIov];
    const ssize_t w = write_iov(iov, gather_staged(iov));
    if (w < 0) return;
    advance(static_cast<std::size_t>(w));
    backlog_.fetch_sub(static_cast<std::size_t>(w), std::memory_order_relaxed);
  }
  // All written. The flush posted to the I/O thread finds nothing left and does the rest of a completed flush there
  // (a reader paused for the backlog, a close that waited for it).
  drop_written();
  flush_owned_ = false;
}

// The staged bytes not yet written, up to kMaxIov segments, as `iov`; returns how many. wmutex_ held.
int TcpConnection::gather_staged(iovec* iov) const {
  int n = 0;
  for (std::size_t i = seg_i_; i < segs_.size() && n < kMaxIov; ++i) {
    const Seg& s = segs_[i];
    const char* base = s.ext ? s.ext : stage_.data() + s.off;
    const std::size_t skip = i == seg_i_ ? seg_done_ : 0;
    iov[n++] = {const_cast<char*>(base + skip), s.len - skip};
  }
  return n;
}

void TcpConnection::advance(std::size_t w) {
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

// I/O thread, TLS: what is staged goes out through the TLS session in one asynchronous gathered write at a time.
// The write takes the staged buffers (and the tensors and bodies they point into) with it, so senders keep
// staging into fresh ones meanwhile; flush_owned_ stays set until nothing is left.
void TcpConnection::flush_encrypted() {
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

// Everything staged has been written: the staging buffers and what they kept alive go. wmutex_ held.
void TcpConnection::drop_written() {
  backlog_.store(0, std::memory_order_relaxed);
  stage_.clear();
  segs_.clear();
  seg_i_ = seg_done_ = 0;
  keep_tensors_.clear();
  keep_bodies_.clear();
}

// Everything staged has been written. wmutex_ held by `lock`.
void TcpConnection::flushed(std::unique_lock<std::mutex>& lock) {
  drop_written();
  if (paused_) room_timer_.cancel();  // a reader paused for the backlog may go on
  flush_owned_ = false;
  if (close_when_flushed_) {
    lock.unlock();
    fail("closed");
  }
}

}  // namespace corpc::detail
