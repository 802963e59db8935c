// The same-host channel: between two workers on one host, large tensor data goes through a shared ring.
// Every check runs on the channel and on TCP (the option off), compares element for element, and asserts through
// the process's counters which path each message took, so that a silent fall-back to TCP fails the test.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <dirent.h>
#include <doctest/doctest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "../src/transport/shm_channel.hpp"
#include "support.hpp"

namespace test_shm_channel {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

constexpr std::int64_t kKiB = 1024, kMiB = 1024 * 1024;
constexpr std::uint64_t kRing = 4 * kMiB;  // small, so that "larger than the ring" is cheap

std::vector<at::Tensor> echo(std::vector<at::Tensor> ts) { return ts; }
at::Tensor echo_one(at::Tensor t) { return t; }
std::vector<std::uint64_t> counters() {
  auto& c = corpc::detail::shm_counters();
  return {c.messages_sent.load(), c.messages_received.load(), c.bytes_sent.load(), c.bytes_received.load()};
}
// Descriptors of this process that are memfds: the channel closes its own once the segment is mapped.
int open_memfds() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) {
    char target[256];
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t k = ::readlink(path.c_str(), target, sizeof target - 1);
    if (k > 0 && std::string(target, static_cast<std::size_t>(k)).find("memfd:") != std::string::npos) ++n;
  }
  ::closedir(d);
  return n;
}
// Same-host segments this process has mapped (the channel keeps its mapping, not its descriptor).
int mapped_segments() {
  std::ifstream maps("/proc/self/maps");
  std::set<std::string> inodes;  // one segment is one mapping, but count by file in case it is ever split
  for (std::string line; std::getline(maps, line);)
    if (line.find("memfd:corpc-same-host") != std::string::npos) {
      std::istringstream fields(line);
      std::string range, perms, offset, dev, inode;
      fields >> range >> perms >> offset >> dev >> inode;
      inodes.insert(inode);
    }
  return static_cast<int>(inodes.size());
}
at::Tensor make_large(std::int64_t bytes) { return at::full({bytes}, 7, at::kByte); }
int die_on_receipt(at::Tensor) {
  ::raise(SIGKILL);
  return 0;
}

// Elements that depend on `seed` and on their index, in any dtype (bool: alternating; float: exact small integers).
at::Tensor pattern(std::int64_t numel, std::int64_t seed, at::ScalarType dtype) {
  at::set_num_threads(1);
  auto t = at::arange(numel, at::kLong).mul_(7).add_(seed).remainder_(dtype == at::kBool ? 2 : 113);
  if (at::isComplexType(dtype)) return at::complex(t.to(at::kFloat), t.neg().to(at::kFloat)).to(dtype);
  return t.to(dtype);
}

RpcOptions channel_options(bool on) {
  RpcOptions o = quick_options();
  o.same_host_channel = on;
  o.same_host_ring_bytes = kRing;
  return o;
}

// The channel is set up just after the Hellos, alongside the first calls: echo until a large reply came through it.
void wait_for_channel(int peer) {
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  const at::Tensor probe = pattern(kMiB, 1, at::kByte);
  while (counters()[1] == 0) {
    EXPECT(std::chrono::steady_clock::now() < deadline);
    EXPECT(at::equal(rpc_sync<&echo_one>(peer, probe), probe));
  }
}

}  // namespace

TEST_CASE(
    "ring regions: released in any order, never handed out twice; a peer's bad offsets and segments are refused") {
  using corpc::detail::ShmChannel;
  auto dialer = ShmChannel::create(256 * kKiB);
  dialer->enable_sending();
  auto acceptor = ShmChannel::attach(dialer->fd());
  dialer->close_fd();
  const std::uint64_t ring = dialer->ring_bytes();
  // Four regions of a quarter fill the ring; a fifth does not fit until one is released, whichever one.
  std::vector<std::uint64_t> offsets;
  for (int i = 0; i < 4; ++i) {
    auto r = dialer->reserve(ring / 4);
    REQUIRE(r);
    std::memset(r->data, i + 1, ring / 4);
    offsets.push_back(r->offset);
    char* seen = acceptor->receive(r->offset, ring / 4);
    CHECK(seen[0] == i + 1);
    CHECK(seen[ring / 4 - 1] == i + 1);
  }
  CHECK_FALSE(dialer->reserve(1));
  CHECK(acceptor->held_bytes() == ring);
  acceptor->release(offsets[2]);  // not the oldest
  auto again = dialer->reserve(ring / 4);
  REQUIRE(again);
  CHECK(again->offset == offsets[2]);
  CHECK_FALSE(dialer->reserve(1));
  // The receiver refuses regions that overlap what it holds, or lie outside the ring, or are misaligned.
  CHECK_THROWS_AS(acceptor->receive(offsets[0], 64), ProtocolError);
  CHECK_THROWS_AS(acceptor->receive(ring - 64, 128), ProtocolError);
  CHECK_THROWS_AS(acceptor->receive(offsets[2] + 1, 64), ProtocolError);
  // The acceptor sends the other way, on its own ring.
  auto back = acceptor->reserve(ring);
  REQUIRE(back);
  CHECK(dialer->receive(back->offset, ring) != nullptr);
  // A segment the peer could still shrink (unsealed) is refused.
  const int unsealed = ::memfd_create("not-sealed", MFD_CLOEXEC);
  REQUIRE(::ftruncate(unsealed, 1 << 20) == 0);
  CHECK_THROWS(ShmChannel::attach(unsealed));
  ::close(unsealed);
}

TEST_CASE("every dtype, layout and size class carries the same bytes over the same-host channel and over TCP") {
  const std::vector<at::ScalarType> dtypes = {at::kBool,  at::kByte,   at::kChar,         at::kShort,
                                              at::kInt,   at::kLong,   at::kHalf,         at::kBFloat16,
                                              at::kFloat, at::kDouble, at::kComplexFloat, at::kComplexDouble};
  // Bytes of the contiguous tensor: empty, small, just over the threshold, mid, and larger than the ring. The gapped
  // layout sends half of them (its elements only): below the threshold, ..., still larger than the ring.
  const std::vector<std::int64_t> sizes = {0, 1000, 100 * kKiB, kMiB + 96, 9 * kMiB};
  for (const bool on : {true, false}) {
    CAPTURE(on);
    run_world(
        2,
        [&](int rank) {
          if (rank != 0) return;
          if (on) wait_for_channel(1);
          for (auto dtype : dtypes) {
            const std::int64_t item = static_cast<std::int64_t>(c10::elementSize(dtype));
            for (std::int64_t bytes : sizes) {
              const std::int64_t numel = bytes / item / 2 * 2;
              const at::Tensor base = pattern(numel, bytes + item, dtype);
              // contiguous; dense but not contiguous (sent as it is, strides kept); with gaps (only elements travel).
              const std::vector<at::Tensor> layouts = {base, base.view({2, numel / 2}).t(), base.slice(0, 0, numel, 2)};
              for (std::size_t l = 0; l < layouts.size(); ++l) {
                const at::Tensor& sent = layouts[l];
                const auto wire = static_cast<std::uint64_t>(sent.numel() * item);
                const std::uint64_t expected = on && wire >= corpc::detail::kShmMinBytes && wire <= kRing / 3 ? 1 : 0;
                const auto before = counters();
                const at::Tensor back = rpc_sync<&echo>(1, std::vector<at::Tensor>{sent})[0];
                const auto after = counters();
                CAPTURE(dtype);
                CAPTURE(bytes);
                CAPTURE(l);
                EXPECT(back.scalar_type() == dtype);
                EXPECT(back.sizes() == sent.sizes());
                if (l < 2) EXPECT(back.strides() == sent.strides());
                EXPECT(at::equal(back, sent));
                EXPECT_EQ(after[0] - before[0], expected);  // our request
                EXPECT_EQ(after[1] - before[1], expected);  // its reply
                EXPECT_EQ(after[2] - before[2], expected * wire);
              }
            }
          }
          // Several tensors of odd sizes in one message: each starts aligned in the ring, and comes back where it was.
          const std::vector<at::Tensor> mixed = {
              pattern(1001, 3, at::kChar), pattern(25 * kKiB + 1, 4, at::kFloat),
              pattern(3, 5, at::kDouble),  at::empty({0, 4}),
              pattern(7, 6, at::kBool),    pattern(40 * kKiB, 7, at::kHalf).view({-1, 8}).t()};
          const auto before = counters();
          const auto back = rpc_sync<&echo>(1, mixed);
          EXPECT_EQ(counters()[1] - before[1], on ? 1u : 0u);
          EXPECT_EQ(back.size(), mixed.size());
          for (std::size_t i = 0; i < mixed.size(); ++i) EXPECT(at::equal(back[i], mixed[i]));
          // No memfd is left open on either side; with the option off, nothing went through shared memory there either.
          EXPECT_EQ(open_memfds(), 0);
          EXPECT_EQ(rpc_sync<&open_memfds>(1), 0);
          if (!on) EXPECT(rpc_sync<&counters>(1) == std::vector<std::uint64_t>(4, 0));
        },
        channel_options(on));
  }
}

TEST_CASE("a channel is set up only once a large message crosses the connection, and a large reply sets it up too") {
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        // Small calls only: no segment on either side, however long the connection lives.
        const at::Tensor small = pattern(kKiB, 1, at::kByte);
        for (int i = 0; i < 200; ++i) EXPECT(at::equal(rpc_sync<&echo_one>(1, small), small));
        std::this_thread::sleep_for(300ms);  // what an eager set-up would have finished in
        EXPECT_EQ(mapped_segments(), 0);
        EXPECT_EQ(rpc_sync<&mapped_segments>(1), 0);
        EXPECT(counters() == std::vector<std::uint64_t>(4, 0));
        // Small requests, large replies: the peer (the acceptor) cannot set a channel up, so the first large reply,
        // read here by TCP, is what sets it up; later replies come through it.
        const auto deadline = std::chrono::steady_clock::now() + 20s;
        int calls = 0;
        while (counters()[1] == 0) {
          EXPECT(std::chrono::steady_clock::now() < deadline);
          EXPECT_EQ(rpc_sync<&make_large>(1, kMiB).numel(), kMiB);
          ++calls;
        }
        EXPECT(calls >= 2);  // the first large reply went by TCP
        EXPECT_EQ(mapped_segments(), 1);
        EXPECT_EQ(rpc_sync<&mapped_segments>(1), 1);
      },
      channel_options(true));
}

TEST_CASE("received tensors held at once keep their bytes, and one kept for long does not block the ring") {
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        wait_for_channel(1);
        // 16 MiB held through a 4 MiB ring: the first replies stay views of the ring (their regions must not be
        // reused), the later ones are copied out; either way every one keeps its own bytes.
        std::vector<at::Tensor> sent, back;
        const auto before = counters();
        for (int i = 0; i < 16; ++i) {
          sent.push_back(pattern(kMiB / 4, 1000 + i, at::kFloat));
          back.push_back(rpc_sync<&echo_one>(1, sent.back()));
        }
        EXPECT(counters()[1] - before[1] == 16u);
        for (int i = 0; i < 16; ++i) EXPECT(at::equal(back[i], sent[i]));
        back[0].add_(1);  // a view of the ring is an ordinary tensor: writable, resizable
        EXPECT(at::equal(back[0], sent[0] + 1));
        back[1].resize_({2 * kMiB});
        EXPECT(at::equal(back[1].narrow(0, 0, kMiB / 4), sent[1]));
        // One reply kept for long pins only its own region: the traffic after it still goes through the ring.
        back.resize(1);
        const auto later = counters();
        for (int i = 0; i < 20; ++i) EXPECT(at::equal(rpc_sync<&echo_one>(1, sent[i % 16]), sent[i % 16]));
        EXPECT(counters()[1] - later[1] == 20u);
        EXPECT(at::equal(back[0], sent[0] + 1));
      },
      channel_options(true));
}

TEST_CASE("a peer killed while a tensor is in its ring fails the call with ConnectionError") {
  expect_only_rank_lost(1, "signal", [&] {
    run_world(
        2,
        [&](int rank) {
          if (rank != 0) return;
          wait_for_channel(1);
          const auto before = counters();
          auto doomed = rpc_async<&die_on_receipt>(1, pattern(kMiB, 9, at::kFloat));
          auto also = rpc_async<&echo_one>(1, pattern(kMiB / 2, 10, at::kFloat));  // in flight behind it
          EXPECT_THROWS_AS(doomed.wait(20s), ConnectionError);
          EXPECT_THROWS_AS(also.wait(20s), ConnectionError);
          EXPECT(counters()[0] - before[0] >= 1u);  // the doomed tensor did go through the ring
          EXPECT_THROWS_AS(rpc_sync<&echo_one>(1, pattern(kMiB, 11, at::kFloat)), ConnectionError);
        },
        channel_options(true));
  });
}

}  // namespace test_shm_channel
