// Tensor transfer paths: large receives reuse pooled memory (no page faults in steady state), and every
// path carries the same bytes, element for element.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <doctest/doctest.h>
#include <sys/resource.h>

#include "../src/memory/host_block_cache.hpp"
#include "support.hpp"

namespace test_transfer {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using Pool = corpc::detail::HostBlockCache;

namespace {

constexpr std::int64_t kMiB = 1 << 20;

std::int64_t minor_faults() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

at::Tensor echo(at::Tensor t) { return t; }
std::int64_t faults_here() { return minor_faults(); }

// A tensor whose every element depends on `seed`, so that a stale or shared buffer shows up as a mismatch. One
// thread: intra-op threads in forked ranks on a loaded machine cost seconds here.
at::Tensor pattern(std::int64_t numel, std::int64_t seed, at::ScalarType dtype = at::kFloat) {
  at::set_num_threads(1);
  return at::arange(numel, at::kInt).mul_(7).add_(seed).bitwise_and_(255).to(dtype);
}

}  // namespace

TEST_CASE("block cache: a released block is reused for its size class; cached memory stays under the bound") {
  auto& pool = Pool::instance();
  pool.set_cache_limit(8 * kMiB);
  REQUIRE(pool.acquire(Pool::kMinBytes - 1) == nullptr);  // small requests: the ordinary allocator
  void* a = pool.acquire(3 * kMiB);
  REQUIRE(a != nullptr);
  const std::size_t capacity = Pool::size_class(3 * kMiB);
  REQUIRE(capacity >= 3 * kMiB);
  REQUIRE(capacity == Pool::size_class(3 * kMiB - 4096));  // one class covers nearby sizes
  REQUIRE(pool.release(a) == capacity);
  void* b = pool.acquire(3 * kMiB - 100);
  REQUIRE(b == a);                   // the cached block, not a fresh mapping
  void* c = pool.acquire(3 * kMiB);  // b is in use: another block
  REQUIRE(c != b);
  int not_ours = 0;
  REQUIRE(pool.release(&not_ours) == 0);  // anything else is refused, untouched
  pool.release(b);
  pool.release(c);
  REQUIRE(pool.cached_bytes() == 2 * capacity);
  void* big = pool.acquire(6 * kMiB);
  pool.release(big);  // over the 8 MiB bound: the least recently used go
  REQUIRE(pool.cached_bytes() <= 8 * kMiB);
  pool.set_cache_limit(0);  // off: everything cached is unmapped, and nothing is pooled
  REQUIRE(pool.cached_bytes() == 0);
  REQUIRE(pool.acquire(4 * kMiB) == nullptr);
}

// Steady state: after two warm-up echoes of a 16 MiB tensor (4096 pages of 4 KiB), the next echoes take (almost) no
// minor page faults on either side. Bound on TCP (the same-host channel off): fewer than 16 faults per echo on average
// on each side, i.e. under 0.4% of the pages a fresh buffer costs (the pool off, measured: about 4100 per echo); the
// residue is small allocations. On the same-host channel the data never touches the block cache: a sender's ring
// uses two or three regions in turn (the peer may not have released the last one yet when the next is sent), each
// faulted in once per connection at its first use, which a loaded machine may delay into the measure: there the
// bound is one region's pages over the whole measure (4096 + the same residue), against 8 x 4100 for fresh buffers.
TEST_CASE("steady receives of one size take no page faults, and carry the same bytes") {
  constexpr int kWarm = 2, kSteady = 8;
  constexpr std::int64_t kNumel = 4 * kMiB;  // floats: 16 MiB
  for (const bool same_host : {false, true}) {
    RpcOptions options = quick_options();
    options.same_host_channel = same_host;
    run_world(
        2,
        [&](int rank) {
          if (rank != 0) return;
          std::vector<at::Tensor> tensors;  // made first: the measure counts the transfers, not the making
          const at::Tensor base = pattern(kNumel, 0);
          for (int i = 0; i < kWarm + kSteady; ++i) tensors.push_back(base + i);
          std::int64_t here = 0, there = 0;
          for (int i = 0; i < kWarm + kSteady; ++i) {
            if (i == kWarm) {
              here = minor_faults();
              there = rpc_sync<&faults_here>(1);
            }
            const at::Tensor& sent = tensors[i];
            at::Tensor back = rpc_sync<&echo>(1, sent);
            EXPECT(at::equal(back, sent));
          }
          const std::int64_t here_total = minor_faults() - here;
          const std::int64_t there_total = rpc_sync<&faults_here>(1) - there;
          MESSAGE("same-host channel " << same_host << ": minor faults per 16 MiB echo in steady state: caller "
                                       << here_total / kSteady << ", callee " << there_total / kSteady);
          const std::int64_t bound = same_host ? 4096 + 16 * kSteady : 16 * kSteady;
          EXPECT(here_total < bound);
          EXPECT(there_total < bound);
        },
        options);
  }
}

TEST_CASE("received tensors held at once keep their own buffers") {
  run_world(2, [&](int rank) {
    if (rank != 0) return;
    std::vector<at::Tensor> sent, back;
    for (int i = 0; i < 4; ++i) {
      sent.push_back(pattern(kMiB, 100 + i, at::kInt));
      back.push_back(rpc_sync<&echo>(1, sent.back()));
    }
    for (int i = 0; i < 4; ++i) EXPECT(at::equal(back[i], sent[i]));
    back[0].resize_({8 * kMiB});  // outgrows its pooled block: moves to the default allocator
    EXPECT(at::equal(back[0].narrow(0, 0, kMiB), sent[0]));
  });
}

// A training step allocates and frees the same large activations every step: with the host allocator (the default)
// the second round of allocations reuses the first round's pages, so it takes no page faults, and the memory is
// the same block; with HostMemoryOptions::cache_cpu_allocations off every round is fresh memory from libtorch's allocator (the bytes
// are faulted in again). Both are checked, so the test fails if the allocator is not installed or not used.
TEST_CASE("large CPU allocations reuse cached pages when the host allocator is on, and not when it is off") {
  for (const bool on : {true, false}) {
    run_world(
        1,
        [&](int) {
          // After init_rpc, which applied the defaults: the latest configuration holds.
          HostMemoryOptions memory;
          memory.cache_cpu_allocations = on;
          configure_host_memory(memory);
          // Floats: 64 MiB, 16384 pages. Above glibc's largest mmap threshold (32 MiB), so without the cache every
          // allocation is a fresh mapping, whatever the heap's history in this process.
          constexpr std::int64_t kNumel = 16 * kMiB;
          const void* first = nullptr;
          std::int64_t faults_before = 0;
          for (int round = 0; round < 3; ++round) {
            if (round == 1) faults_before = minor_faults();
            at::Tensor t = at::empty({kNumel});
            t.fill_(static_cast<float>(round));  // touches every page
            if (round == 0) first = t.data_ptr();
            if (on && round > 0) EXPECT(t.data_ptr() == first);  // (a fresh mapping may land at the same address)
            EXPECT(t[kNumel - 1].item<float>() == static_cast<float>(round));
          }
          const std::int64_t per_round = (minor_faults() - faults_before) / 2;
          MESSAGE("cache_cpu_allocations " << on
                                           << ": minor faults per 64 MiB allocation after the first: " << per_round);
          if (on) EXPECT(per_round < 16);
          else EXPECT(per_round > 4000);  // glibc maps and unmaps a buffer this size every time
        },
        quick_options());
  }
}

}  // namespace test_transfer
