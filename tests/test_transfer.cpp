// Tensor transfer paths (issue 14): large receives reuse pooled memory (no page faults in steady state), and every
// path carries the same bytes, element for element.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <sys/resource.h>

#include "../src/receive_pool.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using Pool = corpc::detail::ReceivePool;

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

TEST_CASE("receive pool: a released block is reused for its size class; cached memory stays under the bound") {
  auto& pool = Pool::instance();
  pool.set_cache_limit(8 * kMiB);
  REQUIRE(pool.acquire(Pool::kMinBytes - 1) == nullptr);  // small receives: the ordinary allocator
  auto* a = pool.acquire(3 * kMiB);
  REQUIRE(a != nullptr);
  REQUIRE(a->capacity >= 3 * kMiB);
  REQUIRE(a->capacity == Pool::size_class(3 * kMiB - 4096));  // one class covers nearby sizes
  void* data = a->data;
  pool.release(a);
  auto* b = pool.acquire(3 * kMiB - 100);
  REQUIRE(b->data == data);  // the cached block, not a fresh mapping
  auto* c = pool.acquire(3 * kMiB);  // b is in use: another block
  REQUIRE(c->data != b->data);
  pool.release(b);
  pool.release(c);
  REQUIRE(pool.cached_bytes() == b->capacity + c->capacity);
  auto* big = pool.acquire(6 * kMiB);
  pool.release(big);  // over the 8 MiB bound: the least recently used go
  REQUIRE(pool.cached_bytes() <= 8 * kMiB);
  pool.set_cache_limit(0);  // off: everything cached is unmapped, and nothing is pooled
  REQUIRE(pool.cached_bytes() == 0);
  REQUIRE(pool.acquire(4 * kMiB) == nullptr);
}

// Steady state: after two warm-up echoes of a 16 MiB tensor (4096 pages of 4 KiB), the next echoes take (almost) no
// minor page faults on either side. Bound: fewer than 16 faults per echo on average on each side, i.e. under 0.4%
// of the pages a fresh buffer costs (the pool off, measured: about 4100 per echo); the residue is small allocations.
TEST_CASE("steady receives of one size take no page faults, and carry the same bytes") {
  constexpr int kWarm = 2, kSteady = 8;
  constexpr std::int64_t kNumel = 4 * kMiB;  // floats: 16 MiB
  run_world(2, [&](int rank) {
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
    const std::int64_t here_per_echo = (minor_faults() - here) / kSteady;
    const std::int64_t there_per_echo = (rpc_sync<&faults_here>(1) - there) / kSteady;
    MESSAGE("minor faults per 16 MiB echo in steady state: caller " << here_per_echo << ", callee " << there_per_echo);
    EXPECT(here_per_echo < 16);
    EXPECT(there_per_echo < 16);
  });
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
