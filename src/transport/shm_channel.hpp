// The same-host channel: when both ends of a TCP connection run on one host, the tensor data of large
// messages goes through a shared-memory ring instead of the socket; TCP still carries every frame (the frame is the
// doorbell and keeps the order), and carries the data itself whenever the ring has no room. Private to the runtime.
//
// Why a persistent ring: measured between two processes on these VMs (64 MiB), a memcpy moves 15-19 GB/s, a
// persistent shared segment (copy in, copy out) 8-9 GB/s, process_vm_readv 5-6, loopback TCP 1-3.5, and a fresh
// memfd per transfer 0.2 (mapping and faulting in new pages dominates). So one segment is made per connection, and
// the receiver may even use the ring's bytes in place (a received tensor is then a view of the ring, and its region
// is given back when the tensor is freed), which leaves one copy per transfer.
//
// Setting up (offered during the handshake, never assumed): both Hellos carry the host's identity (boot id and
// network namespace); the acceptor's answer also carries the name of its abstract Unix socket and a fresh cookie. If
// the identities match, the dialer, once the first large message crosses the connection either way (at once where
// CUDA IPC is agreed: src/rpc/same_host.cpp), makes the segment (a sealed memfd: the peer can neither shrink nor grow
// it), connects to that socket and passes the descriptor with the cookie (SCM_RIGHTS); the cookie travelled only over
// the authenticated TCP connection, so the Unix socket is as authenticated as TCP. Each side maps the segment and
// closes the descriptor. Anything failing leaves the connection on TCP (logged once).
//
// Segment: [control pages: two release queues][ring 0: dialer -> acceptor][ring 1: acceptor -> dialer]. The sender
// of a ring allocates its regions (under its connection's write lock; first fit from the start, so that a steady
// exchange keeps touching the same pages) and says the region's offset in the frame. The
// receiver may keep a region as long as the tensors made on it live, and releases regions in any order through a
// single-producer queue in the control pages, which the sender drains when it allocates: a tensor kept for long
// pins only its own bytes. A sender never waits for room: a message that does not fit goes by TCP, so no thread
// ever blocks on the peer, and a receiver that keeps everything only slows its sender down to TCP speed.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/refusal_log.hpp"

namespace corpc::detail {

// Messages whose tensor data is at least this large go through the ring (below, one memcpy more costs about what a
// small socket write does, and the ring's bookkeeping is not worth it).
inline constexpr std::uint64_t kShmMinBytes = 64 * 1024;
// Each message's region, and each tensor in it, starts at this alignment (vectorized kernels read tensors in place).
inline constexpr std::uint64_t kShmAlign = 64;

// Process-wide counters: tensor bytes that went through a same-host ring (sent, received). Tests check them, so that a
// silent fall-back to TCP shows.
struct ShmCounters {
  std::atomic<std::uint64_t> bytes_sent{0}, bytes_received{0}, messages_sent{0}, messages_received{0};
};
ShmCounters& shm_counters();
// While set, senders ignore their channels (everything goes by TCP): lets a benchmark compare both paths in one run.
void set_shm_sends_paused(bool paused);
bool shm_sends_paused() noexcept;

// This host's identity as the channel understands it: boot id and network namespace (abstract Unix sockets are per
// namespace). Empty if it cannot be read (then no channel is offered or accepted).
const std::string& same_host_identity();

class ShmChannel : public std::enable_shared_from_this<ShmChannel> {
 public:
  enum class Side { dialer, acceptor };

  // The dialer's side: a fresh sealed memfd of two rings of `ring_bytes`, mapped. Throws std::system_error.
  static std::shared_ptr<ShmChannel> create(std::uint64_t ring_bytes);
  // The acceptor's side, from the descriptor the dialer passed (not closed here). Throws std::runtime_error if the
  // segment is not one (size, seals, header).
  static std::shared_ptr<ShmChannel> attach(int fd);
  ~ShmChannel();
  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  int fd() const noexcept { return fd_; }  // until close_fd (the dialer passes it on)
  void close_fd() noexcept;
  std::uint64_t ring_bytes() const noexcept { return ring_bytes_; }

  // Sending starts once the peer has mapped the segment (the dialer: when it acknowledges; the acceptor: at once).
  bool can_send() const noexcept { return sending_.load(std::memory_order_acquire); }
  void enable_sending() noexcept { sending_.store(true, std::memory_order_release); }

  // Sender (serialized by the connection's write lock): a free region of `len` bytes, or nullopt if the ring has
  // no room for it now.
  struct Region {
    std::uint64_t offset;  // in the ring, sent in the frame
    char* data;
  };
  std::optional<Region> reserve(std::uint64_t len);

  // Receiver (the connection's I/O thread): the bytes of the region [offset, offset+len) the peer announced; throws
  // ProtocolError if it is outside the ring or overlaps a region still held. The region stays the receiver's until
  // release(offset) (any thread, any order).
  char* receive(std::uint64_t offset, std::uint64_t len);
  void release(std::uint64_t offset) noexcept;
  // Bytes of regions received and not yet released.
  std::uint64_t held_bytes() const noexcept { return held_.load(std::memory_order_relaxed); }

 private:
  ShmChannel(int fd, void* base, std::uint64_t map_bytes, std::uint64_t ring_bytes, Side side);
  struct Control;
  Control* control() const noexcept;
  char* ring(int which) const noexcept;

  int fd_;
  void* base_;
  std::uint64_t map_bytes_;
  std::uint64_t ring_bytes_;
  int send_ring_, recv_ring_;
  std::atomic<bool> sending_{false};
  // Sender (write lock): regions the peer has not released, offset -> length.
  std::map<std::uint64_t, std::uint64_t> sent_;
  // Receiver (release_mutex_): regions held, offset -> length; releases the full queue could not take yet.
  std::mutex release_mutex_;
  std::map<std::uint64_t, std::uint64_t> held_regions_;
  std::vector<std::uint64_t> unqueued_;
  std::atomic<std::uint64_t> held_{0};
  bool publish_release(std::uint64_t offset) noexcept;
};

// The acceptor's end of the set-up: an abstract Unix socket on which dialers pass their segments. One per runtime,
// on its main I/O thread.
class ShmListener {
 public:
  using OnAttach = std::function<void(std::shared_ptr<ShmChannel>)>;
  // Throws std::system_error if the socket cannot be bound.
  ShmListener(asio::io_context& io, std::string worker);
  ~ShmListener();
  const std::string& name() const noexcept { return name_; }
  // A fresh cookie for one connection's channel: when a dialer presents `claim_of(cookie)` (the cookie itself if
  // claim_of is empty; rank_identity.hpp's channel_claim binds it to the connection) with its segment, `on_attach`
  // gets the mapped channel (on the listener's thread). One use. Any thread.
  std::string offer(OnAttach on_attach, std::function<bool()> still_wanted,
                    const std::function<std::string(const std::string&)>& claim_of = {});
  void close();

 private:
  void accept_next();
  asio::awaitable<void> session(asio::local::stream_protocol::socket socket);

  asio::io_context& io_;
  std::string worker_;
  std::string name_;
  // Anyone on the host can connect to the socket and fail the set-up at will: refusals are logged at a bounded rate.
  RefusalLog refusals_{"same-host channel", "set-ups refused on its Unix socket"};
  asio::local::stream_protocol::acceptor acceptor_;
  std::mutex mutex_;
  struct Offer {
    OnAttach on_attach;
    std::function<bool()> still_wanted;
  };
  std::map<std::string, Offer> offers_;
  // Offers of connections that have gone are dropped when the map reaches this size, then set to twice what is left:
  // each offer costs O(1) amortized, not a scan of every offer (a rank of a large job makes one per peer).
  std::size_t sweep_at_ = 64;
};

// The dialer's end: makes the segment, hands `install` the channel (so that the connection can receive through it
// before the peer may send), passes it to `socket_name` with `cookie`, and enables sending once the peer has mapped
// it. Returns an empty string, or why the channel could not be set up (the connection then stays on TCP).
asio::awaitable<std::string> dial_shm_channel(std::string socket_name, std::string cookie, std::uint64_t ring_bytes,
                                              std::function<void(std::shared_ptr<ShmChannel>)> install,
                                              std::chrono::milliseconds timeout);

}  // namespace corpc::detail
