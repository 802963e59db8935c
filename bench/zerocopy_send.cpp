// Does MSG_ZEROCOPY make large TCP sends faster here? ("MSG_ZEROCOPY or similar for large sends if
// it measures faster"). A standalone experiment, no corpc: one process sends a buffer of N bytes over 127.0.0.1 to a
// reader thread, which acknowledges each buffer with one byte; a transfer is timed from the first send to the ack.
// Plain send() and send(MSG_ZEROCOPY) alternate transfer by transfer (interleaved, DESIGN.md section 4); the zero-copy
// sender also waits for the kernel's completion notifications before it reuses its buffer (as a real sender must),
// and counts how many of them say the kernel copied after all (SO_EE_CODE_ZEROCOPY_COPIED, which loopback does).
//
//   ninja -C build bench/zerocopy_send && build/bench/zerocopy_send [rounds]   (or: g++ -O2 -std=c++20 -pthread)
#include <arpa/inet.h>
#include <linux/errqueue.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#ifndef SO_EE_ORIGIN_ZEROCOPY
#define SO_EE_ORIGIN_ZEROCOPY 5
#endif
#ifndef SO_EE_CODE_ZEROCOPY_COPIED
#define SO_EE_CODE_ZEROCOPY_COPIED 1
#endif

namespace {

void die(const char* what) {
  std::perror(what);
  std::exit(1);
}

struct Completions {
  std::uint32_t done = 0;    // notifications covering this many send calls
  std::uint64_t copied = 0;  // of which the kernel reported copying
};

// Reads zero-copy notifications from the error queue; returns how many send calls they covered.
void reap(int fd, Completions& c, bool block) {
  for (;;) {
    if (block) {
      pollfd p{fd, 0, 0};  // POLLERR is always reported
      ::poll(&p, 1, 1000);
    }
    char control[128];
    msghdr msg{};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    if (::recvmsg(fd, &msg, MSG_ERRQUEUE | MSG_DONTWAIT) < 0) {
      if (errno == EAGAIN) return;
      die("recvmsg(MSG_ERRQUEUE)");
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm; cm = CMSG_NXTHDR(&msg, cm)) {
      auto* ee = reinterpret_cast<sock_extended_err*>(CMSG_DATA(cm));
      if (ee->ee_origin != SO_EE_ORIGIN_ZEROCOPY) continue;
      const std::uint32_t n = ee->ee_data - ee->ee_info + 1;  // an inclusive range of send-call ids
      c.done += n;
      if (ee->ee_code & SO_EE_CODE_ZEROCOPY_COPIED) c.copied += n;
    }
    block = false;
  }
}

double transfer(int fd, const char* buf, std::size_t n, bool zerocopy, std::uint32_t& calls, Completions& c) {
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t sent = 0;
  while (sent < n) {
    ssize_t k = ::send(fd, buf + sent, n - sent, zerocopy ? MSG_ZEROCOPY : 0);
    if (k < 0) {
      if (errno == ENOBUFS && zerocopy) {  // too many notifications outstanding: reap, retry
        reap(fd, c, true);
        continue;
      }
      die("send");
    }
    sent += static_cast<std::size_t>(k);
    if (zerocopy) ++calls;
  }
  if (zerocopy)
    while (c.done < calls) reap(fd, c, true);  // the buffer may be reused only now
  char ack;
  if (::recv(fd, &ack, 1, MSG_WAITALL) != 1) die("recv ack");
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const int per_round = 10;
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) || ::listen(listener, 1) ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len))
    die("listen");
  int sender = ::socket(AF_INET, SOCK_STREAM, 0);
  std::thread reader([&] {
    int fd = ::accept(listener, nullptr, nullptr);
    std::vector<char> in(std::size_t{64} << 20);
    for (;;) {
      std::uint64_t n;
      if (::recv(fd, &n, sizeof n, MSG_WAITALL) != sizeof n || n == 0) break;
      for (std::size_t got = 0; got < n;) {
        ssize_t k = ::recv(fd, in.data(), std::min<std::size_t>(in.size(), n - got), 0);
        if (k <= 0) die("recv");
        got += static_cast<std::size_t>(k);
      }
      char ack = 1;
      if (::send(fd, &ack, 1, 0) != 1) die("send ack");
    }
    ::close(fd);
  });
  if (::connect(sender, reinterpret_cast<sockaddr*>(&addr), sizeof addr)) die("connect");
  int one = 1;
  if (::setsockopt(sender, SOL_SOCKET, SO_ZEROCOPY, &one, sizeof one)) die("setsockopt(SO_ZEROCOPY)");
  ::setsockopt(sender, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  std::printf("%8s %5s | %14s %14s %12s | %s\n", "size", "round", "send() med us", "ZEROCOPY med us", "zc/plain",
              "zerocopy sends copied by the kernel");
  for (std::size_t mib : {16, 64}) {
    const std::size_t n = mib << 20;
    std::vector<char> buf(n, 'x');  // touched: no first-use page faults inside a timed transfer
    std::uint32_t calls = 0;
    Completions c;
    std::vector<double> all_ratios;
    for (int r = 0; r < rounds; ++r) {
      std::vector<double> plain, zc;
      const std::uint64_t copied_before = c.copied, calls_before = calls;
      for (int i = 0; i < per_round; ++i) {
        for (bool z : {false, true}) {
          std::uint64_t header = n;
          if (::send(sender, &header, sizeof header, 0) != sizeof header) die("send header");
          (z ? zc : plain).push_back(transfer(sender, buf.data(), n, z, calls, c));
        }
      }
      const double ratio = median(zc) / median(plain);
      all_ratios.push_back(ratio);
      std::printf("%5zu MiB %5d | %14.0f %14.0f %12.2f | %llu of %llu\n", mib, r, median(plain), median(zc), ratio,
                  static_cast<unsigned long long>(c.copied - copied_before),
                  static_cast<unsigned long long>(calls - calls_before));
    }
    std::printf("%5zu MiB   all | median of the per-round ratios zc/plain: %.2f\n", mib, median(all_ratios));
  }
  std::uint64_t end = 0;
  ::send(sender, &end, sizeof end, 0);
  reader.join();
  ::close(sender);
  ::close(listener);
}
