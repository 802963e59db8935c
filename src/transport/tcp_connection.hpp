// The TCP connection, shared by the files that implement it, one job each:
//   tcp_connection.cpp    made from an accepted transport, its attachments (same-host channel, CUDA IPC), closing
//   tcp_dial.cpp          dialing and authenticating a connection we open
//   tcp_writer.cpp        sending: direct writes from the sending thread, staging, flushing; the dispatch batch that
//                         corks an I/O thread's writes while it delivers the frames of one read
//   tcp_reader.cpp        the read loop: buffered reads, framing, large payloads read straight into their storage
//   tcp_flow_control.cpp  the receive budget and the write backlog that pause reading
//   tcp_liveness.cpp      heartbeats and the silence that declares a peer unreachable
// One class rather than a reader and a writer object: both sides share the socket, the write lock, the attachments
// and the close. What a frame goes through on each side stays within one file (and the batch's state is reachable
// from every file without a call), so the per-frame paths inline as they would in one.
#pragma once

#include <ATen/ATen.h>
#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/connection.hpp"
#include "transport/frame_seal.hpp"

namespace corpc::detail {

// The dispatch batch of the calling I/O thread: open while it delivers the frames of one read. Only what is
// trivially destructible is here, so that the reader reaches it directly (a thread_local with a destructor is reached
// through a call on every use); the list of connections to flush is tcp_writer.cpp's own.
struct BatchState {
  asio::io_context* io = nullptr;  // the io_context this thread runs (set by the read loop)
  int open = 0;
};
extern thread_local constinit BatchState tls_batch;

inline void batch_begin(asio::io_context& io) {
  tls_batch.io = &io;
  ++tls_batch.open;
}
// Flushes every connection written to during the batch that just closed (tcp_writer.cpp).
void flush_batch();
// Ends the batch, if one is open. Checked before every read, hence inline.
inline void batch_end() {
  if (tls_batch.open == 0) return;
  tls_batch.open = 0;
  flush_batch();
}

class TcpConnection final : public Connection {
 public:
  static constexpr std::size_t kReadBuffer =
      64 * 1024;  // frames whose header, metadata and body fit are parsed in place
  // What the read buffer starts with: it grows to kReadBuffer once a read fills it, so that the many connections of a
  // large job that only ever carry a few small frames each hold a page, not 64 KiB of the allocator's heap.
  static constexpr std::size_t kFirstReadBuffer = 4 * 1024;
  static constexpr std::size_t kCopyBodyBelow = 4 * 1024;  // smaller bodies are copied into the staging buffer
  static constexpr std::size_t kCommitStep = 1 << 20;  // how far a large body's memory is committed ahead of its bytes
  static constexpr int kMaxIov = 64;

  TcpConnection(Transport t, const ConnectionSettings& settings, FrameHandler on_frame, CloseHandler on_close);

  // Opening and closing (tcp_connection.cpp, tcp_dial.cpp).
  void start_reading();
  void dial(std::string host, std::uint16_t port, std::string local_socket, AuthConfig auth, FirstFrame first);
  void close(std::string why) override;
  void close_when_flushed() override;
  void attach_shm(std::shared_ptr<ShmChannel> channel) override;
  void set_up_shm_when_needed(std::function<void()> set_up) override;
  void attach_cuda_ipc(std::shared_ptr<CudaIpcLink> link) override;
  // The pending set-up of set_up_shm_when_needed, taken (empty if none, or if it was taken already).
  std::function<void()> take_shm_set_up();
  std::shared_ptr<CudaIpcLink> cuda_ipc() override;
  std::shared_ptr<CudaIpcLink> cuda_ipc_for_lending() override;
  std::string handshake_transcript() const override { return transport_.session_keys().transcript; }
  void hold_sends() override;
  void release_sends() override;

  // Writing (tcp_writer.cpp).
  void send(OutFrame&& f) override;
  // I/O thread: writes what is staged; waits for writability when the socket is full.
  void flush_now();
  // The thread that staged frames (outside the I/O threads), before it blocks: writes what it can, never waits.
  void flush_from_sender() noexcept;

  // Flow control (tcp_flow_control.cpp).
  void release_receive(std::uint64_t bytes) noexcept override;

 private:
  struct Seg {
    const char* ext;  // external memory (tensor storage, a large body), or nullptr: stage_ + off
    std::size_t off;
    std::size_t len;
  };

  std::shared_ptr<TcpConnection> self() { return std::static_pointer_cast<TcpConnection>(shared_from_this()); }

  // Opening and closing.
  static asio::awaitable<void> connect(std::shared_ptr<TcpConnection> self, std::string host, std::uint16_t port,
                                       std::string local_socket, AuthConfig auth, FirstFrame first);
  void fail(const std::string& why);
  // Frame integrity (frame_seal.hpp), once the transport is authenticated: a no-op without keys.
  void install_seals();

  // Writing.
  void send_frame(OutFrame&& f, bool released);  // `released`: a held frame, now going out
  // Under the write lock: `f`'s tag, into `tag`, over exactly what goes on the socket; null without a seal.
  const FrameSeal::Tag* seal_outgoing(const OutFrame& f, FrameSeal::Tag& tag);
  // Under the write lock, with nothing queued: writes `f` from this thread, stages what the socket did not take, and
  // closes the connection (unlocking first) if the write failed.
  void write_now(OutFrame& f, const FrameSeal::Tag* sealed, std::unique_lock<std::mutex>& lock);
  bool corked_here() const noexcept {
    return tls_batch.open > 0 && tls_batch.io == &const_cast<TcpConnection*>(this)->io();
  }
  ssize_t write_iov(iovec* iov, int n);
  void stage(OutFrame& f, std::size_t skip, const FrameSeal::Tag* tag);
  void stage_first(const std::string& bytes);  // ahead of everything staged, before anything was written
  void schedule_flush();
  void advance(std::size_t w);
  int gather_staged(iovec* iov) const;  // what is left to write, as at most kMaxIov segments
  void drop_written();                  // after everything staged was written
  void flush_encrypted();
  void flushed(std::unique_lock<std::mutex>& lock);

  // Reading.
  static asio::awaitable<void> read_loop(std::shared_ptr<TcpConnection> self);
  asio::awaitable<void> read_frames(std::shared_ptr<Connection> base);
  asio::awaitable<void> read_more();
  void grow_read_buffer();
  std::size_t take_buffered(char* dst, std::size_t len);
  asio::awaitable<void> read_growing(std::string& dst, std::size_t len);
  std::vector<at::Tensor> decode_tensors(const FrameHeader& h, const char* meta, std::size_t len, Message& msg);
  asio::awaitable<void> discard(std::uint64_t n);
  asio::awaitable<void> check_seal();  // reads the frame's tag and checks it (seal_in_ set)
  [[noreturn]] static void throw_seal_mismatch();

  // Flow control.
  asio::awaitable<void> wait_for_room(std::uint64_t need);
  bool try_reserve(std::uint64_t need) noexcept;

  // Liveness. A completion condition for long reads: each chunk that arrives is a sign of life.
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
  static constexpr int kLivenessChecks = 4;
  void send_heartbeat(FrameKind kind);
  void schedule_liveness_check();
  void check_liveness();

  Transport transport_;            // reads go through it (TLS or not); plain writes use the socket directly
  asio::ip::tcp::socket& socket_;  // transport_'s
  const ConnectionSettings settings_;
  WireLimits limits_;
  FrameHandler on_frame_;  // I/O thread
  CloseHandler on_close_;  // I/O thread
  // rbuf_size_ bytes (kFirstReadBuffer, then kReadBuffer), not zeroed (I/O thread)
  std::unique_ptr<char[]> rbuf_;
  std::size_t rbuf_size_ = kFirstReadBuffer;
  std::size_t rbeg_ = 0, rend_ = 0;
  asio::steady_timer room_timer_;  // a paused reader waits on it; cancelled when there may be room (I/O thread)
  bool paused_ = false;            // I/O thread
  std::uint64_t pauses_ = 0;       // I/O thread
  std::atomic<std::uint64_t> received_held_{0};      // this connection's share of the receive budget in use
  std::atomic<std::uint64_t> backlog_{0};            // staged bytes not yet written (changed under wmutex_)
  asio::steady_timer liveness_timer_;                // I/O thread, like the counters below
  std::uint64_t heard_ = 0, heard_checked_ = 0;      // reads that brought bytes
  std::uint64_t written_ = 0, written_checked_ = 0;  // staged writes that made progress
  int silent_checks_ = 0;

  std::unique_ptr<FrameSeal> seal_in_;       // I/O thread: checks the frames we receive (null: not sealed)
  std::shared_ptr<ShmChannel> shm_rx_;       // I/O thread: shm_, once a frame needed it
  std::shared_ptr<CudaIpcLink> ipc_rx_;      // I/O thread: ipc_, once attached
  std::atomic<bool> ipc_attached_{false};    // ipc_ was set (spares senders and readers the lock until then)
  std::atomic<bool> shm_wanted_set_{false};  // shm_wanted_ is not empty (spares the reader the lock otherwise)

  std::mutex wmutex_;  // guards everything below, and the socket's descriptor against close while a sender writes
  std::unique_ptr<FrameSeal> seal_out_;  // tags the frames we send, in wire order (null: not sealed)
  std::shared_ptr<ShmChannel> shm_;      // the same-host channel, once set up
  std::function<void()> shm_wanted_;     // sets shm_ up, until a large message calls for it (taken then)
  std::shared_ptr<CudaIpcLink> ipc_;     // CUDA IPC with the peer, once agreed and attached
  std::string stage_;
  std::vector<Seg> segs_;
  std::size_t seg_i_ = 0, seg_done_ = 0;
  std::vector<at::Tensor> keep_tensors_;
  std::vector<std::string> keep_bodies_;
  bool flush_owned_ = false;  // a flush is due: posted, in the batch's dirty list, or waiting for writability
  bool connected_ = false;
  bool closed_ = false;
  bool close_when_flushed_ = false;
  bool holding_ = false;        // hold_sends() .. release_sends()
  std::vector<OutFrame> held_;  // sent while holding, in order
};

}  // namespace corpc::detail
