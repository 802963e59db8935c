// The same-host channel: the shared segment and its rings, and the Unix-socket set-up that passes the segment.
#include "transport/shm_channel.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <string_view>
#include <system_error>

#include "corpc/transport/errors.hpp"
#include "corpc/wire/errors.hpp"

#include "core/log.hpp"
#include "transport/abstract_socket.hpp"
#include "transport/auth.hpp"

namespace corpc::detail {

namespace {

constexpr std::uint64_t kControlBytes = 36864;               // 9 pages
constexpr std::uint64_t kSegmentMagic = 0x314d485343505243;  // "CRPCSHM1"
constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
constexpr std::size_t kCookieChars = 64;  // random_secret()'s length
constexpr int kMaxFds = 4;                // more in one message are closed and refused

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

std::atomic<bool> g_sends_paused{false};

std::system_error os_error(const char* what) { return std::system_error(errno, std::generic_category(), what); }

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string s;
  std::getline(in, s);
  return s;
}

// The two ends of SCM_RIGHTS. They are plain functions, not inlined into the coroutines that call them, because
// g++ 12 does not honour alignas for a local kept in a coroutine frame (UBSan: "misaligned address ... for type
// 'struct cmsghdr'"); a control buffer on an ordinary stack frame is aligned as declared.

// Sends `bytes` with one file descriptor attached; returns sendmsg's result.
[[gnu::noinline]] ssize_t send_with_fd(int socket, std::string_view bytes, int fd) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&mh);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  return ::sendmsg(socket, &mh, MSG_NOSIGNAL);
}

// Receives up to `size` bytes and the descriptors that came with them (up to kMaxFds into `fds`, counted in `nfds`;
// the caller closes them). Returns recvmsg's result; `truncated` tells that descriptors did not fit.
[[gnu::noinline]] ssize_t receive_with_fds(int socket, char* data, std::size_t size, int* fds, int& nfds,
                                           bool& truncated) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  iovec iov{data, size};
  msghdr mh{};
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  mh.msg_control = control;
  mh.msg_controllen = sizeof control;
  const ssize_t n = ::recvmsg(socket, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  for (cmsghdr* c = n < 0 ? nullptr : CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < k && nfds < kMaxFds; ++i)
      std::memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
  }
  truncated = n >= 0 && (mh.msg_flags & MSG_CTRUNC);
  return n;
}

}  // namespace

ShmCounters& shm_counters() {
  static ShmCounters c;
  return c;
}

void set_shm_sends_paused(bool paused) { g_sends_paused.store(paused); }
bool shm_sends_paused() noexcept { return g_sends_paused.load(std::memory_order_relaxed); }

const std::string& same_host_identity() {
  static const std::string id = [] {
    const std::string boot = read_line("/proc/sys/kernel/random/boot_id");
    char ns[128];
    const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns);
    if (boot.empty() || n <= 0) return std::string();
    return boot + "/" + std::string(ns, static_cast<std::size_t>(n));
  }();
  return id;
}

// ---- the segment ------------------------------------------------------------------------------------------------

// The control pages: for each ring, the queue of regions its receiver released (a single producer, the receiver;
// a single consumer, the sender). Lock-free atomics work across processes on a shared mapping.
constexpr std::uint64_t kReleaseSlots = 2000;
struct ShmChannel::Control {
  std::uint64_t magic;
  std::uint64_t ring_bytes;
  struct Queue {
    alignas(64) std::atomic<std::uint64_t> head;  // written by the receiver
    alignas(64) std::atomic<std::uint64_t> tail;  // written by the sender
    std::uint64_t offsets[kReleaseSlots];
  };
  Queue released[2];
};

ShmChannel::Control* ShmChannel::control() const noexcept {
  static_assert(sizeof(Control) <= kControlBytes);
  static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "the rings' counters are shared between processes");
  return static_cast<Control*>(base_);
}

ShmChannel::ShmChannel(int fd, void* base, std::uint64_t map_bytes, std::uint64_t ring_bytes, Side side)
    : fd_(fd),
      base_(base),
      map_bytes_(map_bytes),
      ring_bytes_(ring_bytes),
      send_ring_(side == Side::dialer ? 0 : 1),
      recv_ring_(side == Side::dialer ? 1 : 0) {}

ShmChannel::~ShmChannel() {
  close_fd();
  ::munmap(base_, map_bytes_);
}

void ShmChannel::close_fd() noexcept {
  if (fd_ >= 0) ::close(std::exchange(fd_, -1));
}

char* ShmChannel::ring(int which) const noexcept {
  return static_cast<char*>(base_) + kControlBytes + static_cast<std::uint64_t>(which) * ring_bytes_;
}

std::shared_ptr<ShmChannel> ShmChannel::create(std::uint64_t ring_bytes) {
  ring_bytes = round_up(std::max<std::uint64_t>(ring_bytes, kShmMinBytes), 4096);
  const std::uint64_t size = kControlBytes + 2 * ring_bytes;
  int fd = ::memfd_create("corpc-same-host", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) throw os_error("memfd_create");
  // Sealed before the peer sees it, so that the peer's mapping can never be cut short under it (SIGBUS).
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0 || ::fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    auto e = os_error("sizing the shared segment");
    ::close(fd);
    throw e;
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    auto e = os_error("mmap of the shared segment");
    ::close(fd);
    throw e;
  }
  // Default-initialised: the counters are zeroed, the slot arrays left as the fresh memfd has them (zero, and read
  // only once written), so that only the pages holding the counters are touched.
  auto* c = new (base) Control;
  c->magic = kSegmentMagic;
  c->ring_bytes = ring_bytes;
  return std::shared_ptr<ShmChannel>(new ShmChannel(fd, base, size, ring_bytes, Side::dialer));
}

std::shared_ptr<ShmChannel> ShmChannel::attach(int fd) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (static_cast<unsigned>(seals) & kSeals) != kSeals)
    throw ProtocolError("the segment is not sealed against resizing");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(kControlBytes)) throw ProtocolError("no segment");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) throw os_error("mmap of the shared segment");
  const auto* c = static_cast<const Control*>(base);
  const std::uint64_t ring_bytes = c->ring_bytes;  // read once: the peer could change it later
  if (c->magic != kSegmentMagic || ring_bytes % 4096 || ring_bytes < kShmMinBytes ||
      kControlBytes + 2 * ring_bytes != size) {
    ::munmap(base, size);
    throw ProtocolError("not a corpc segment");
  }
  auto ch = std::shared_ptr<ShmChannel>(new ShmChannel(-1, base, size, ring_bytes, Side::acceptor));
  ch->enable_sending();  // the dialer mapped it before passing it
  return ch;
}

std::optional<ShmChannel::Region> ShmChannel::reserve(std::uint64_t len) {
  len = round_up(std::max<std::uint64_t>(len, 1), kShmAlign);
  if (len > ring_bytes_) return std::nullopt;
  auto& q = control()->released[send_ring_];
  const std::uint64_t head = q.head.load(std::memory_order_acquire);
  std::uint64_t tail = q.tail.load(std::memory_order_relaxed);
  if (head - tail > kReleaseSlots) tail = head - kReleaseSlots;               // a broken peer: take what the slots hold
  for (; tail != head; ++tail) sent_.erase(q.offsets[tail % kReleaseSlots]);  // an unknown offset changes nothing
  q.tail.store(tail, std::memory_order_release);
  // First fit, from the ring's start: a steady exchange keeps using the same few regions, so it touches (and
  // faults in) only those pages, not the whole ring.
  std::uint64_t gap = 0;
  for (const auto& [offset, length] : sent_) {
    if (offset >= gap + len) break;
    gap = offset + length;
  }
  const std::optional<std::uint64_t> at = gap + len <= ring_bytes_ ? std::optional(gap) : std::nullopt;
  if (!at) return std::nullopt;
  sent_.emplace(*at, len);
  return Region{*at, ring(send_ring_) + *at};
}

char* ShmChannel::receive(std::uint64_t offset, std::uint64_t len) {
  len = round_up(std::max<std::uint64_t>(len, 1), kShmAlign);
  std::lock_guard lock(release_mutex_);
  auto next = held_regions_.lower_bound(offset);
  const bool overlaps = (next != held_regions_.end() && next->first < offset + len) ||
                        (next != held_regions_.begin() && std::prev(next)->first + std::prev(next)->second > offset);
  if (offset % kShmAlign || len > ring_bytes_ || offset > ring_bytes_ - len || overlaps)
    throw ProtocolError("a same-host region the peer could not have reserved");
  held_regions_.emplace(offset, len);
  held_.fetch_add(len, std::memory_order_relaxed);
  return ring(recv_ring_) + offset;
}

bool ShmChannel::publish_release(std::uint64_t offset) noexcept {
  auto& q = control()->released[recv_ring_];
  const std::uint64_t head = q.head.load(std::memory_order_relaxed);
  if (head - q.tail.load(std::memory_order_acquire) >= kReleaseSlots) return false;
  q.offsets[head % kReleaseSlots] = offset;
  q.head.store(head + 1, std::memory_order_release);
  return true;
}

void ShmChannel::release(std::uint64_t offset) noexcept {
  std::lock_guard lock(release_mutex_);
  auto it = held_regions_.find(offset);
  if (it == held_regions_.end()) return;
  held_.fetch_sub(it->second, std::memory_order_relaxed);
  held_regions_.erase(it);
  // Older releases first; what the queue cannot take now waits for the next release (the sender drains it whenever
  // it allocates, so it fills only while the sender sends nothing through the ring).
  std::size_t done = 0;
  while (done < unqueued_.size() && publish_release(unqueued_[done])) ++done;
  unqueued_.erase(unqueued_.begin(), unqueued_.begin() + static_cast<std::ptrdiff_t>(done));
  try {
    if (!unqueued_.empty() || !publish_release(offset)) unqueued_.push_back(offset);
  } catch (...) {  // no memory for the note: the region stays lost to the sender, which then uses TCP more often
  }
}

// ---- the set-up -------------------------------------------------------------------------------------------------

ShmListener::ShmListener(asio::io_context& io, std::string worker)
    : io_(io), worker_(std::move(worker)), acceptor_(io) {
  name_ = std::string(1, '\0') + listen_abstract(acceptor_, "corpc");  // dialers get it with its NUL
  accept_next();
}

ShmListener::~ShmListener() { close(); }

void ShmListener::close() {
  asio::error_code ec;
  acceptor_.close(ec);
  std::lock_guard lock(mutex_);
  offers_.clear();
}

std::string ShmListener::offer(OnAttach on_attach, std::function<bool()> still_wanted,
                               const std::function<std::string(const std::string&)>& claim_of) {
  std::string cookie = random_secret();
  const std::string claim = claim_of ? claim_of(cookie) : cookie;
  if (claim.size() != kCookieChars) throw ProtocolError("same-host channel: a claim must be as long as a cookie");
  std::lock_guard lock(mutex_);
  if (offers_.size() >= sweep_at_) {
    for (auto it = offers_.begin(); it != offers_.end();)  // offers whose connection has gone
      it = it->second.still_wanted() ? std::next(it) : offers_.erase(it);
    sweep_at_ = std::max<std::size_t>(64, 2 * offers_.size());
  }
  offers_[claim] = {std::move(on_attach), std::move(still_wanted)};
  return cookie;
}

void ShmListener::accept_next() {
  acceptor_.async_accept([this](const asio::error_code& ec, asio::local::stream_protocol::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) asio::co_spawn(io_, session(std::move(socket)), asio::detached);
    accept_next();
  });
}

asio::awaitable<void> ShmListener::session(asio::local::stream_protocol::socket s) {
  auto socket = std::make_shared<asio::local::stream_protocol::socket>(std::move(s));
  asio::steady_timer timer(io_, std::chrono::seconds(5));  // a silent client is dropped
  timer.async_wait([socket](const asio::error_code& ec) {
    if (!ec) socket->close();
  });
  std::string refused;
  int fds[kMaxFds];
  int nfds = 0;
  try {
    char cookie[kCookieChars];
    bool truncated = false;
    ssize_t n = -1;
    int err = EAGAIN;
    // Readiness is a hint: a wake-up can come before the message (seen with many set-ups at once). The timer above
    // bounds the waiting.
    while (n < 0 && (err == EAGAIN || err == EWOULDBLOCK)) {
      co_await socket->async_wait(asio::socket_base::wait_read, asio::use_awaitable);
      n = receive_with_fds(socket->native_handle(), cookie, sizeof cookie, fds, nfds, truncated);
      err = errno;
    }
    Offer offer;
    if (n != static_cast<ssize_t>(kCookieChars) || nfds != 1 || truncated) {
      refused = fmt::format("a malformed set-up message ({} bytes{}, {} descriptors{})", n,
                            n < 0 ? std::string(": ") + std::strerror(err) : "", nfds, truncated ? ", truncated" : "");
    } else {
      std::lock_guard lock(mutex_);
      auto it = offers_.find(std::string(cookie, kCookieChars));
      if (it == offers_.end()) {
        refused = "an unknown cookie";
      } else {
        offer = std::move(it->second);
        offers_.erase(it);
      }
    }
    if (refused.empty() && offer.still_wanted()) {
      auto channel = ShmChannel::attach(fds[0]);
      offer.on_attach(std::move(channel));
      const char ack = 1;
      co_await asio::async_write(*socket, asio::buffer(&ack, 1), asio::use_awaitable);
    }
  } catch (const std::exception& e) {
    refused = e.what();
  }
  for (int i = 0; i < nfds; ++i) ::close(fds[i]);
  timer.cancel();
  if (!refused.empty())
    refusals_.refused(io_, worker_, fmt::format("refused a set-up on its Unix socket: {}", refused));
}

asio::awaitable<std::string> dial_shm_channel(std::string socket_name, std::string cookie, std::uint64_t ring_bytes,
                                              std::function<void(std::shared_ptr<ShmChannel>)> install,
                                              std::chrono::milliseconds timeout) {
  auto executor = co_await asio::this_coro::executor;
  auto socket = std::make_shared<asio::local::stream_protocol::socket>(executor);
  asio::steady_timer timer(executor, timeout);  // a peer that never answers leaves the connection on TCP
  timer.async_wait([socket](const asio::error_code& ec) {
    if (!ec) socket->close();
  });
  std::string failure;
  try {
    if (cookie.size() != kCookieChars) throw ProtocolError("a malformed cookie");
    auto channel = ShmChannel::create(ring_bytes);
    co_await socket->async_connect(asio::local::stream_protocol::endpoint(socket_name), asio::use_awaitable);
    install(channel);  // before the peer can map it: what it sends through the ring must find us ready
    const ssize_t n =
        send_with_fd(socket->native_handle(), cookie, channel->fd());  // tiny: a fresh socket takes it whole
    channel->close_fd();
    if (n != static_cast<ssize_t>(cookie.size())) throw os_error("passing the segment");
    char ack = 0;
    co_await asio::async_read(*socket, asio::buffer(&ack, 1), asio::use_awaitable);
    if (ack != 1) throw ProtocolError("the peer did not take the segment");
    channel->enable_sending();
  } catch (const std::exception& e) {
    failure = e.what();
    if (failure.empty()) failure = "unknown failure";
  }
  timer.cancel();
  co_return failure;
}

}  // namespace corpc::detail
