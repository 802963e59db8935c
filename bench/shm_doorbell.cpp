// Should small frames between two processes on one host go through shared memory with a doorbell instead of TCP
// loopback? Adopt it only if it wins on latency and throughput without burning a core while idle (PyTorch's shm
// transport polls its rings: about one core per idle process). A standalone experiment, no corpc, no torch: the parent
// forks an echo server per variant and exchanges 64 B and 1 KiB messages with it.
//
// Variants. TCP loopback with TCP_NODELAY: the reader blocks in recv() (tcp), waits in epoll_wait() as Asio's reactor
// does (tcp-epoll), or polls recv() for 50 us before blocking (tcp-spin50, TCP with the spin the shm variants get).
// Shared memory: one single-producer ring per direction in a MAP_SHARED segment mapped before fork. The reader polls its
// ring for S us, then announces that it sleeps (a flag in the segment: store, full fence, recheck the ring, so that a
// writer that published before the announcement is seen) and blocks; a writer publishes, fences, and rings only a
// sleeping reader. The doorbell is an eventfd the reader blocks on in read() (efd-read), or waits for in epoll_wait()
// and then reads (efd-epoll: what corpc's I/O thread would do through an asio::posix::stream_descriptor), or a futex on
// the flag itself (futex; shared, not FUTEX_PRIVATE, since the word is in two processes). shm-spin never sleeps: the
// upper bound of a shared-memory transport, and the cost of one when idle.
//
// Measured per variant and size: ping-pong round trips (median, p99; N=1 msg/s is their rate); paced round trips, one
// every --paced-us, so that each finds the server asleep and pays its wake-up and its spin (the cost of sporadic calls);
// throughput with N = 64 and 1024 messages in flight (the client writes a batch of N and reads their N echoes; the
// server echoes everything it has read with one write or one publish, as a coalescing sender does); CPU time per
// message of both processes under load; and CPU time of both processes while idle (both ends waiting, no messages,
// --idle-ms; all variants' pairs idle at once, since a waiting process does not compete). CPU time is the per-process
// CPU clock (clock_getcpuclockid): exact, and readable while the child runs, where getrusage of a child is not. Each
// round runs every variant, in an order rotated by one per round; the ratios are taken per round against plain tcp of
// the same round, so that load from other work hits both sides of a ratio alike. The defaults take 30-40 s on two
// vCPUs; every case has a fixed count.
//
//   ninja -C build bench/shm_doorbell && build/bench/shm_doorbell [--rounds 5] [--messages 32768] [--pings 3000]
//       [--paced-pings 100] [--paced-us 500] [--idle-ms 1000] [--sizes 64,1024] [--only efd-epoll,futex]
//       [--reference tcp-epoll]      (or: g++ -O2 -std=c++20 bench/shm_doorbell.cpp; the reference always runs)
#include <arpa/inet.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "bench_util.hpp"

namespace {

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

std::int64_t clock_ns(clockid_t id) {
  timespec ts;
  if (::clock_gettime(id, &ts) != 0) die("clock_gettime");
  return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
}
using corpc::bench::now_ns;

clockid_t cpu_clock_of(pid_t pid) {
  clockid_t c;
  if (int e = ::clock_getcpuclockid(pid, &c)) {
    errno = e;
    die("clock_getcpuclockid");
  }
  return c;
}

std::string loadavg() {
  char buf[128] = {};
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (!f) return "?";
  if (!std::fgets(buf, sizeof buf, f)) buf[0] = 0;
  std::fclose(f);
  std::string s(buf);
  auto cut = s.find(' ', s.find(' ', s.find(' ') + 1) + 1);  // the 1, 5 and 15-minute averages
  return s.substr(0, cut);
}

enum class Transport { kTcp, kShm };
enum class Wait { kBlock, kEpoll, kNever, kEventfd, kEventfdEpoll, kFutex };

struct Variant {
  std::string name;
  Transport transport;
  Wait wait;
  int spin_us;  // polling before the reader sleeps; < 0: never sleeps
};

struct Hdr {
  std::uint32_t len;
  std::uint32_t seq;
};
constexpr std::uint32_t kPad = 0xfffffffe;   // the rest of the ring up to its end is unused
constexpr std::uint32_t kQuit = 0xffffffff;  // the server exits

void spin_pause() { _mm_pause(); }

// Polls ready() for spin_us (forever if negative); true once it is.
template <class F>
bool poll_for(int spin_us, F&& ready) {
  if (spin_us == 0) return false;
  const std::int64_t deadline = now_ns() + std::int64_t{spin_us} * 1000;
  for (unsigned i = 1;; ++i) {
    if (ready()) return true;
    spin_pause();
    if (i % 16 == 0 && spin_us > 0 && now_ns() >= deadline) return false;
  }
}

// An epoll instance watching one descriptor for input, as Asio's reactor waits (only when the variant asks).
class EpollOn {
 public:
  EpollOn(bool wanted, int fd) {
    if (!wanted) return;
    ep_ = ::epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    if (ep_ < 0 || ::epoll_ctl(ep_, EPOLL_CTL_ADD, fd, &ev) != 0) die("epoll");
  }
  EpollOn(const EpollOn&) = delete;
  EpollOn& operator=(const EpollOn&) = delete;
  ~EpollOn() {
    if (ep_ >= 0) ::close(ep_);
  }
  void wait() const {
    epoll_event ev;
    if (::epoll_wait(ep_, &ev, 1, -1) < 0 && errno != EINTR) die("epoll_wait");
  }

 private:
  int ep_ = -1;
};

// ---------------------------------------------------------------------------------------------------------------------
// TCP

class TcpEnd {
 public:
  TcpEnd(int fd, const Variant& v) : fd_(fd), v_(v), in_(std::size_t{8} << 20), epoll_(v.wait == Wait::kEpoll, fd) {}

  // Waits for bytes as the variant does and appends them; false at end of stream.
  bool receive() {
    ssize_t n = -1;
    if (poll_for(v_.spin_us, [&] { return (n = try_recv()) >= 0; })) return n > 0;
    if (v_.wait == Wait::kEpoll) {
      while ((n = try_recv()) < 0) epoll_.wait();  // a speculative read first, as Asio does
      return n > 0;
    }
    do n = ::recv(fd_, in_.data() + end_, in_.size() - end_, 0);
    while (n < 0 && errno == EINTR);
    if (n < 0) die("recv");
    end_ += static_cast<std::size_t>(n);
    return n > 0;
  }

  // Calls f(hdr, payload) for each complete frame received; returns how many.
  template <class F>
  std::size_t take(F&& f) {
    std::size_t frames = 0, at = 0;
    while (end_ - at >= sizeof(Hdr)) {
      Hdr h;
      std::memcpy(&h, in_.data() + at, sizeof h);
      if (end_ - at < sizeof h + h.len) break;
      f(h, in_.data() + at + sizeof h);
      at += sizeof h + h.len;
      ++frames;
    }
    std::memmove(in_.data(), in_.data() + at, end_ - at);
    end_ -= at;
    return frames;
  }

  void write_all(const char* p, std::size_t n) {
    while (n > 0) {
      ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
      if (k < 0 && errno == EINTR) continue;
      if (k < 0) die("send");
      p += k;
      n -= static_cast<std::size_t>(k);
    }
  }

  // Writes a batch while reading what comes back, so that neither side blocks in a write the other does not drain;
  // returns the frames received meanwhile.
  template <class F>
  std::size_t write_reading(const char* p, std::size_t n, F&& f) {
    std::size_t frames = 0;
    while (n > 0) {
      ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        p += k;
        n -= static_cast<std::size_t>(k);
        continue;
      }
      if (k < 0 && errno != EAGAIN && errno != EINTR) die("send");
      ssize_t r = try_recv();
      if (r == 0) die("peer closed");
      if (r > 0) {
        frames += take(f);
        continue;
      }
      pollfd pf{fd_, POLLIN | POLLOUT, 0};
      ::poll(&pf, 1, -1);
    }
    return frames;
  }

 private:
  // -1: nothing yet; 0: end of stream.
  ssize_t try_recv() {
    ssize_t n = ::recv(fd_, in_.data() + end_, in_.size() - end_, MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) return -1;
      die("recv");
    }
    end_ += static_cast<std::size_t>(n);
    return n;
  }

  int fd_;
  Variant v_;
  std::vector<char> in_;
  std::size_t end_ = 0;
  EpollOn epoll_;
};

void tcp_server(int fd, const Variant& v) {
  TcpEnd e(fd, v);
  std::vector<char> out;
  for (;;) {
    if (!e.receive()) return;
    out.clear();
    e.take([&](const Hdr& h, const char* payload) {
      const char* hp = reinterpret_cast<const char*>(&h);
      out.insert(out.end(), hp, hp + sizeof h);
      out.insert(out.end(), payload, payload + h.len);
    });
    if (!out.empty()) e.write_all(out.data(), out.size());
  }
}

class TcpClient {
 public:
  TcpClient(int fd, const Variant& v) : e_(fd, v) {}

  // n messages of size bytes out, their n echoes back.
  void batch(std::size_t n, std::size_t size) {
    const std::vector<char>& b = frames(n, size);
    std::size_t got = 0;
    auto check = [&](const Hdr& h, const char*) {
      if (h.len != size || h.seq != got) die("bad echo");
      ++got;
    };
    e_.write_reading(b.data(), b.size(), check);
    while (got < n) {
      if (!e_.receive()) die("server closed");
      e_.take(check);
    }
  }

 private:
  const std::vector<char>& frames(std::size_t n, std::size_t size) {
    if (n != n_ || size != size_) {
      n_ = n, size_ = size;
      buf_.assign(n * (sizeof(Hdr) + size), 'x');
      for (std::size_t i = 0; i < n; ++i) {
        Hdr h{static_cast<std::uint32_t>(size), static_cast<std::uint32_t>(i)};
        std::memcpy(buf_.data() + i * (sizeof h + size), &h, sizeof h);
      }
    }
    return buf_;
  }

  TcpEnd e_;
  std::vector<char> buf_;
  std::size_t n_ = 0, size_ = 0;
};

// ---------------------------------------------------------------------------------------------------------------------
// Shared memory

constexpr std::uint64_t kRingBytes = std::uint64_t{2} << 20;  // a batch of 1024 1 KiB messages fits

struct Ring {
  alignas(64) std::atomic<std::uint64_t> head{0};      // bytes published by the writer
  alignas(64) std::atomic<std::uint64_t> tail{0};      // bytes released by the reader
  alignas(64) std::atomic<std::uint32_t> sleeping{0};  // the reader is, or is about to be, blocked; the futex word
  alignas(64) char data[kRingBytes];
};
static_assert(std::atomic<std::uint32_t>::is_always_lock_free && sizeof(std::atomic<std::uint32_t>) == 4);

std::uint64_t record_bytes(std::uint32_t len) { return sizeof(Hdr) + (len == kQuit ? 0 : (len + 7) / 8 * 8); }

using corpc::bench::futex;

class RingWriter {
 public:
  RingWriter(Ring* r, int efd, Wait w) : r_(r), efd_(efd), wait_(w), head_(r->head.load()) {}

  void stage(std::uint32_t len, std::uint32_t seq, const char* payload) {
    const std::uint64_t rec = record_bytes(len);
    std::uint64_t off = head_ % kRingBytes;
    const std::uint64_t pad = off + rec > kRingBytes ? kRingBytes - off : 0;
    while (head_ + pad + rec - r_->tail.load(std::memory_order_acquire) > kRingBytes) spin_pause();
    if (pad) {
      const Hdr p{kPad, 0};
      std::memcpy(r_->data + off, &p, sizeof p);
      head_ += pad;
      off = 0;
    }
    const Hdr h{len, seq};
    std::memcpy(r_->data + off, &h, sizeof h);
    if (len != kQuit) std::memcpy(r_->data + off + sizeof h, payload, len);
    head_ += rec;
  }

  void publish() {
    r_->head.store(head_, std::memory_order_release);
    // Pairs with the reader's fence between announcing sleep and rechecking the ring: either it sees this head, or
    // this load sees its flag.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (r_->sleeping.load(std::memory_order_relaxed) && r_->sleeping.exchange(0)) ring();
  }

 private:
  void ring() {
    if (wait_ == Wait::kFutex) {
      if (futex(&r_->sleeping, FUTEX_WAKE, 1) < 0) die("futex wake");
      return;
    }
    const std::uint64_t one = 1;
    if (::write(efd_, &one, sizeof one) != sizeof one) die("eventfd write");
  }

  Ring* r_;
  int efd_;
  Wait wait_;
  std::uint64_t head_;
};

class RingReader {
 public:
  RingReader(Ring* r, int efd, const Variant& v)
      : r_(r), efd_(efd), v_(v), tail_(r->tail.load()), end_(tail_), epoll_(v.wait == Wait::kEventfdEpoll, efd) {}

  // Returns once there is something to read.
  void wait() {
    if (ready() || poll_for(v_.spin_us, [&] { return ready(); })) return;
    for (;;) {
      r_->sleeping.store(1, std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (ready()) {
        // A writer that saw the flag meanwhile rang anyway: that costs one spurious wake-up later, never a lost one.
        r_->sleeping.store(0, std::memory_order_relaxed);
        return;
      }
      block();
      r_->sleeping.store(0, std::memory_order_relaxed);
      if (ready()) return;
    }
  }

  // The next message up to the head wait() saw; false when there is none.
  bool next(Hdr& h, const char*& payload) {
    while (tail_ != end_) {
      const std::uint64_t off = tail_ % kRingBytes;
      std::memcpy(&h, r_->data + off, sizeof h);
      if (h.len == kPad) {
        tail_ += kRingBytes - off;
        continue;
      }
      payload = r_->data + off + sizeof h;
      tail_ += record_bytes(h.len);
      return true;
    }
    return false;
  }

  void release() { r_->tail.store(tail_, std::memory_order_release); }

 private:
  bool ready() {
    end_ = r_->head.load(std::memory_order_acquire);
    return end_ != tail_;
  }

  void block() {
    std::uint64_t v;
    switch (v_.wait) {
      case Wait::kFutex:  // returns at once if a writer already cleared the flag
        if (futex(&r_->sleeping, FUTEX_WAIT, 1) < 0 && errno != EAGAIN && errno != EINTR) die("futex wait");
        return;
      case Wait::kEventfd:
        if (::read(efd_, &v, sizeof v) < 0 && errno != EINTR) die("eventfd read");
        return;
      case Wait::kEventfdEpoll: {
        epoll_.wait();
        if (::read(efd_, &v, sizeof v) < 0 && errno != EAGAIN && errno != EINTR) die("eventfd read");
        return;
      }
      default: die("block");
    }
  }

  Ring* r_;
  int efd_;
  Variant v_;
  std::uint64_t tail_, end_;
  EpollOn epoll_;
};

// Two rings and their eventfds, created before fork: [0] parent to child, [1] child to parent.
struct ShmPair {
  Ring* ring[2];
  int efd[2];
  void* base;
  std::size_t bytes;

  explicit ShmPair(const Variant& v) {
    bytes = 2 * sizeof(Ring);
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (base == MAP_FAILED) die("mmap");
    for (int i = 0; i < 2; ++i) {
      ring[i] = new (static_cast<char*>(base) + i * sizeof(Ring)) Ring;
      efd[i] = ::eventfd(0, EFD_CLOEXEC | (v.wait == Wait::kEventfdEpoll ? EFD_NONBLOCK : 0));
      if (efd[i] < 0) die("eventfd");
    }
  }
  ~ShmPair() {
    ::close(efd[0]);
    ::close(efd[1]);
    ::munmap(base, bytes);
  }
};

// Reads from ring in, echoes into ring out, until kQuit.
void shm_server(ShmPair& s, int in, const Variant& v) {
  const int out = 1 - in;
  RingReader rd(s.ring[in], s.efd[in], v);
  RingWriter wr(s.ring[out], s.efd[out], v.wait);
  std::vector<char> buf(1 << 16);
  for (;;) {
    rd.wait();
    Hdr h;
    const char* payload;
    while (rd.next(h, payload)) {
      if (h.len == kQuit) return;
      std::memcpy(buf.data(), payload, h.len);
      wr.stage(h.len, h.seq, buf.data());
    }
    rd.release();
    wr.publish();
  }
}

class ShmClient {
 public:
  ShmClient(ShmPair& s, const Variant& v)
      : rd_(s.ring[1], s.efd[1], v), wr_(s.ring[0], s.efd[0], v.wait), payload_(1 << 16, 'x'), buf_(1 << 16) {}

  void batch(std::size_t n, std::size_t size) {
    for (std::size_t i = 0; i < n; ++i)
      wr_.stage(static_cast<std::uint32_t>(size), static_cast<std::uint32_t>(i), payload_.data());
    wr_.publish();
    for (std::size_t got = 0; got < n;) {
      rd_.wait();
      Hdr h;
      const char* p;
      while (rd_.next(h, p)) {
        if (h.len != size || h.seq != got) die("bad echo");
        std::memcpy(buf_.data(), p, h.len);
        ++got;
      }
      rd_.release();
    }
  }

  void quit() {
    wr_.stage(kQuit, 0, nullptr);
    wr_.publish();
  }

 private:
  RingReader rd_;
  RingWriter wr_;
  std::vector<char> payload_, buf_;
};

// ---------------------------------------------------------------------------------------------------------------------
// Measurement

struct Options {
  int rounds = 5;
  long messages = 32768;   // per pipelined run
  long pings = 3000;       // round trips per latency run
  long paced_pings = 100;  // round trips one every paced_us, the receiver having gone to sleep in between
  int paced_us = 500;
  int idle_ms = 1000;
  std::vector<std::size_t> sizes{64, 1024};
  std::vector<std::string> only;
  std::string reference = "tcp";  // the denominator of the ratios
};

constexpr std::size_t kInFlight[] = {1, 64, 1024};

struct Result {
  double rtt_med_us = 0, rtt_p99_us = 0;
  double paced_rtt_us = 0, paced_cpu_us = 0;  // median round trip and CPU per round trip when paced
  double rate[3] = {};                        // messages/s for kInFlight
  double cpu_us_per_msg[3] = {};              // both processes
};

using corpc::bench::median;

void connected_tcp_pair(int fds[2]) {
  int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) || ::listen(listener, 1) ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len))
    die("listen");
  fds[0] = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (::connect(fds[0], reinterpret_cast<sockaddr*>(&addr), sizeof addr)) die("connect");
  fds[1] = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
  if (fds[1] < 0) die("accept");
  ::close(listener);
  const int one = 1;
  for (int i = 0; i < 2; ++i)
    if (::setsockopt(fds[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one)) die("TCP_NODELAY");
}

template <class Client>
Result measure(Client& c, pid_t child, std::size_t size, const Options& o) {
  const clockid_t child_cpu = cpu_clock_of(child);
  auto cpu = [&] { return clock_ns(CLOCK_PROCESS_CPUTIME_ID) + clock_ns(child_cpu); };
  // Warm-up: caches, the scheduler's placement, and every page of the rings at least once.
  for (int i = 0; i < 200; ++i) c.batch(1, size);
  for (std::uint64_t moved = 0; moved < kRingBytes; moved += 1024 * record_bytes(size)) c.batch(1024, size);

  Result r;
  std::vector<double> rtts;
  rtts.reserve(o.pings);
  std::int64_t c0 = cpu(), t0 = now_ns();
  for (long i = 0; i < o.pings; ++i) {
    const std::int64_t t = now_ns();
    c.batch(1, size);
    rtts.push_back((now_ns() - t) / 1e3);
  }
  r.rate[0] = o.pings / ((now_ns() - t0) / 1e9);
  r.cpu_us_per_msg[0] = (cpu() - c0) / 1e3 / o.pings;
  std::sort(rtts.begin(), rtts.end());
  r.rtt_med_us = median(rtts);
  r.rtt_p99_us = rtts[static_cast<std::size_t>(0.99 * (rtts.size() - 1))];
  // Sporadic calls: each arrives after the server has spun out its S us and slept, and the spin is paid per call.
  rtts.clear();
  c0 = cpu();
  timespec next;
  ::clock_gettime(CLOCK_MONOTONIC, &next);
  for (long i = 0; i < o.paced_pings; ++i) {
    next.tv_nsec += o.paced_us * 1000L;
    next.tv_sec += next.tv_nsec / 1'000'000'000;
    next.tv_nsec %= 1'000'000'000;
    while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &next, nullptr) == EINTR) {}
    const std::int64_t t = now_ns();
    c.batch(1, size);
    rtts.push_back((now_ns() - t) / 1e3);
  }
  r.paced_cpu_us = (cpu() - c0) / 1e3 / o.paced_pings;
  r.paced_rtt_us = median(rtts);
  for (int k = 1; k < 3; ++k) {
    const std::size_t n = kInFlight[k];
    const long batches = std::max<long>(1, (o.messages + n - 1) / n);
    c0 = cpu(), t0 = now_ns();
    for (long b = 0; b < batches; ++b) c.batch(n, size);
    r.rate[k] = batches * n / ((now_ns() - t0) / 1e9);
    r.cpu_us_per_msg[k] = (cpu() - c0) / 1e3 / (batches * n);
  }
  return r;
}

// One variant, all sizes, against one forked echo server.
std::vector<Result> run_variant(const Variant& v, const Options& o) {
  std::vector<Result> out;
  if (v.transport == Transport::kTcp) {
    int fds[2];
    connected_tcp_pair(fds);
    const pid_t pid = ::fork();
    if (pid < 0) die("fork");
    if (pid == 0) {
      ::close(fds[0]);
      tcp_server(fds[1], v);
      ::_exit(0);
    }
    ::close(fds[1]);
    {
      TcpClient c(fds[0], v);
      for (std::size_t size : o.sizes) out.push_back(measure(c, pid, size, o));
    }
    ::close(fds[0]);  // the server sees the end of the stream
    ::waitpid(pid, nullptr, 0);
    return out;
  }
  ShmPair s(v);
  const pid_t pid = ::fork();
  if (pid < 0) die("fork");
  if (pid == 0) {
    shm_server(s, 0, v);
    ::_exit(0);
  }
  {
    ShmClient c(s, v);
    for (std::size_t size : o.sizes) out.push_back(measure(c, pid, size, o));
    c.quit();
  }
  ::waitpid(pid, nullptr, 0);
  return out;
}

// CPU of every variant's two ends while both wait for a message that does not come, in ms per second of wall time.
std::vector<double> measure_idle(const std::vector<Variant>& vs, const Options& o) {
  struct Pair {
    pid_t pid[2];
    ShmPair* shm = nullptr;
    int fds[2] = {-1, -1};
  };
  std::vector<Pair> pairs(vs.size());
  for (std::size_t i = 0; i < vs.size(); ++i) {
    Pair& p = pairs[i];
    if (vs[i].transport == Transport::kTcp) connected_tcp_pair(p.fds);
    else p.shm = new ShmPair(vs[i]);
    for (int side = 0; side < 2; ++side) {
      p.pid[side] = ::fork();
      if (p.pid[side] < 0) die("fork");
      if (p.pid[side] == 0) {
        if (p.shm) shm_server(*p.shm, side, vs[i]);
        else tcp_server(p.fds[side], vs[i]);
        ::_exit(0);
      }
    }
  }
  ::usleep(100'000);  // every end has started and reached its wait
  std::vector<std::int64_t> before(vs.size());
  auto cpu = [&](const Pair& p) { return clock_ns(cpu_clock_of(p.pid[0])) + clock_ns(cpu_clock_of(p.pid[1])); };
  for (std::size_t i = 0; i < vs.size(); ++i) before[i] = cpu(pairs[i]);
  const std::int64_t t0 = now_ns();
  ::usleep(o.idle_ms * 1000);
  const double seconds = (now_ns() - t0) / 1e9;
  std::vector<double> out;
  for (std::size_t i = 0; i < vs.size(); ++i) out.push_back((cpu(pairs[i]) - before[i]) / 1e6 / seconds);
  for (Pair& p : pairs) {
    for (pid_t pid : p.pid) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    delete p.shm;
    for (int fd : p.fds)
      if (fd >= 0) ::close(fd);
  }
  return out;
}

std::vector<Variant> all_variants() {
  std::vector<Variant> v{{"tcp", Transport::kTcp, Wait::kBlock, 0},
                         {"tcp-epoll", Transport::kTcp, Wait::kEpoll, 0},
                         {"tcp-spin50", Transport::kTcp, Wait::kBlock, 50},
                         {"shm-spin", Transport::kShm, Wait::kNever, -1}};
  const std::pair<const char*, Wait> doorbells[] = {
      {"efd-read", Wait::kEventfd}, {"efd-epoll", Wait::kEventfdEpoll}, {"futex", Wait::kFutex}};
  for (auto [name, w] : doorbells)
    for (int s : {0, 5, 20, 50}) v.push_back({std::string(name) + " s" + std::to_string(s), Transport::kShm, w, s});
  return v;
}

Options parse(int argc, char** argv) {
  corpc::bench::Flags flags(
      argc, argv, {"rounds", "messages", "pings", "paced-pings", "paced-us", "idle-ms", "sizes", "only", "reference"},
      {});
  Options o;
  try {
    flags.check();
    o.rounds = flags.get_int<int>("rounds", o.rounds);
    o.messages = flags.get_int("messages", o.messages);
    o.pings = flags.get_int("pings", o.pings);
    o.paced_pings = flags.get_int("paced-pings", o.paced_pings);
    o.paced_us = flags.get_int<int>("paced-us", o.paced_us);
    o.idle_ms = flags.get_int<int>("idle-ms", o.idle_ms);
    o.sizes.clear();
    for (long size : flags.get_list("sizes", "64,1024")) {
      if (size < 1 || size > 32768) throw corpc::bench::FlagError("--sizes: each in 1..32768 bytes");
      o.sizes.push_back(static_cast<std::size_t>(size));
    }
    for (std::string rest = flags.get("only", ""); !rest.empty();) {
      const auto comma = rest.find(',');
      o.only.push_back(rest.substr(0, comma));
      rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    }
    o.reference = flags.get("reference", o.reference);
    if (o.rounds < 1 || o.messages < 1 || o.pings < 1 || o.paced_pings < 1 || o.paced_us < 1 || o.idle_ms < 1)
      throw corpc::bench::FlagError("counts must be positive");
  } catch (const corpc::bench::FlagError& e) {
    std::fprintf(stderr,
                 "%s\nusage: %s [--rounds N] [--messages N] [--pings N] [--paced-pings N] [--paced-us US] "
                 "[--idle-ms MS] [--sizes 64,1024] [--only NAME,...] [--reference NAME]\n",
                 e.what(), argv[0]);
    std::exit(2);
  }
  return o;
}

std::string ratio_cell(const std::vector<double>& r) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f (%.2f-%.2f)", median(r), *std::min_element(r.begin(), r.end()),
                *std::max_element(r.begin(), r.end()));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::vector<Variant> vs;
  for (const Variant& v : all_variants()) {
    bool keep = o.only.empty() || v.name == o.reference;
    for (const std::string& s : o.only) keep = keep || v.name.find(s) != std::string::npos;
    if (keep) vs.push_back(v);
  }
  const std::size_t nv = vs.size(), ns = o.sizes.size();
  const std::size_t ref =
      std::find_if(vs.begin(), vs.end(), [&](const Variant& v) { return v.name == o.reference; }) - vs.begin();
  if (ref == nv) {
    std::fprintf(stderr, "no variant named %s\n", o.reference.c_str());
    return 2;
  }
  std::printf("shm_doorbell: %d rounds, %ld pings, %ld messages per pipelined run, %d ms idle; load %s\n", o.rounds,
              o.pings, o.messages, o.idle_ms, loadavg().c_str());
  std::fflush(stdout);
  const std::int64_t start = now_ns();
  // results[size][variant][round], idle[variant][round]
  std::vector<std::vector<std::vector<Result>>> results(ns, std::vector<std::vector<Result>>(nv));
  std::vector<std::vector<double>> idle(nv);
  for (int round = 0; round < o.rounds; ++round) {
    for (std::size_t k = 0; k < nv; ++k) {
      const std::size_t vi = (k + round) % nv;
      const std::vector<Result> r = run_variant(vs[vi], o);
      for (std::size_t si = 0; si < ns; ++si) results[si][vi].push_back(r[si]);
    }
    const std::vector<double> id = measure_idle(vs, o);
    for (std::size_t vi = 0; vi < nv; ++vi) idle[vi].push_back(id[vi]);
    std::fprintf(stderr, "round %d done, %.1f s, load %s\n", round + 1, (now_ns() - start) / 1e9, loadavg().c_str());
  }

  for (std::size_t si = 0; si < ns; ++si) {
    std::printf(
        "\n%zu B messages, medians of %d rounds. rtt: round trip (paced: one every %d us); msg/s in thousands;\n"
        "cpu: both processes per message; idle: CPU ms per s of both ends waiting (1000 = a core)\n",
        o.sizes[si], o.rounds, o.paced_us);
    std::printf("%-13s %7s %7s %7s | %7s %7s %7s | %6s %6s %6s %6s | %6s\n", "", "rtt us", "p99", "paced", "N=1",
                "N=64", "N=1024", "cpu us", "N=64", "N=1024", "paced", "idle");
    std::printf("%-13s %7s %7s %7s | %7s %7s %7s | %6s %6s %6s %6s | %6s\n", "variant", "med", "", "med", "kmsg/s", "",
                "", "N=1", "", "", "", "ms/s");
    for (std::size_t vi = 0; vi < nv; ++vi) {
      auto med = [&](auto field) {
        std::vector<double> x;
        for (const Result& r : results[si][vi]) x.push_back(field(r));
        return median(x);
      };
      std::printf(
          "%-13s %7.1f %7.1f %7.1f | %7.0f %7.0f %7.0f | %6.2f %6.2f %6.2f %6.2f | %6.1f\n", vs[vi].name.c_str(),
          med([](const Result& r) { return r.rtt_med_us; }), med([](const Result& r) { return r.rtt_p99_us; }),
          med([](const Result& r) { return r.paced_rtt_us; }), med([](const Result& r) { return r.rate[0] / 1e3; }),
          med([](const Result& r) { return r.rate[1] / 1e3; }), med([](const Result& r) { return r.rate[2] / 1e3; }),
          med([](const Result& r) { return r.cpu_us_per_msg[0]; }),
          med([](const Result& r) { return r.cpu_us_per_msg[1]; }),
          med([](const Result& r) { return r.cpu_us_per_msg[2]; }), med([](const Result& r) { return r.paced_cpu_us; }),
          median(idle[vi]));
    }
    std::printf("\n%zu B messages, per-round ratios to %s: median (min-max); rtt below 1 and msg/s above 1 beat %s\n",
                o.sizes[si], o.reference.c_str(), o.reference.c_str());
    std::printf("%-13s %19s %19s %19s %19s %19s\n", "variant", "rtt med", "paced rtt med", "N=1 msg/s", "N=64 msg/s",
                "N=1024 msg/s");
    for (std::size_t vi = 0; vi < nv; ++vi) {
      if (vi == ref) continue;
      std::vector<double> rtt, paced, rate[3];
      for (int round = 0; round < o.rounds; ++round) {
        const Result &x = results[si][vi][round], &t = results[si][ref][round];
        rtt.push_back(x.rtt_med_us / t.rtt_med_us);
        paced.push_back(x.paced_rtt_us / t.paced_rtt_us);
        for (int k = 0; k < 3; ++k) rate[k].push_back(x.rate[k] / t.rate[k]);
      }
      std::printf("%-13s %19s %19s %19s %19s %19s\n", vs[vi].name.c_str(), ratio_cell(rtt).c_str(),
                  ratio_cell(paced).c_str(), ratio_cell(rate[0]).c_str(), ratio_cell(rate[1]).c_str(),
                  ratio_cell(rate[2]).c_str());
    }
  }
  std::printf("\n%.1f s; load %s\n", (now_ns() - start) / 1e9, loadavg().c_str());
}
