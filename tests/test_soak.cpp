// A bounded soak: four workers mix calls, references (created, forked to a third worker, dropped) and distributed
// backward passes for a while, sampling their resident memory. Passes if, after a warm-up, no worker's RSS keeps
// growing, and at the end no reference and no context is left anywhere.
//   meson test -C build soak                                                   ~20 s (CI)
//   CORPC_SOAK_SECONDS=600 build/tests/test_channels -sf='*/test_soak.cpp'    the long run (docs/testing.md)
#include <ATen/ATen.h>
#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/common_interface_defs.h>
#endif

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rref/rref.hpp"

#include "leak_checks.hpp"
#include "support.hpp"

namespace test_soak {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;

namespace {

constexpr int kWorld = 4;

std::int64_t rss_bytes() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<std::int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

// ThreadSanitizer loads this binary's debug information the first time it symbolizes a stack, which it does for every
// race it detects, suppressed ones included (tests/sanitizers/tsan.supp: a tensor's last release inside libc10, whose
// timing varies from run to run). That is a one-time step of ~40 MiB of RSS, at whatever time the first such race
// comes; symbolizing one address before the warm-up takes the step out of the measurement. Without ThreadSanitizer
// this does nothing.
void load_sanitizer_symbols() {
#if defined(__SANITIZE_THREAD__)
  char where[256];
  __sanitizer_symbolize_pc(__builtin_return_address(0), "%p %F", where, sizeof where);
#endif
}

int add(int a, int b) { return a + b; }
at::Tensor make_tensor(std::int64_t n) { return at::ones({n}); }
Task<double> sum_of(RRef<at::Tensor> r) { co_return (co_await r.to_here()).sum().item<double>(); }
at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }
std::atomic<int> g_finished{0};  // on rank 0: workers done with their loop
void finished() { ++g_finished; }

}  // namespace

TEST_CASE("mixed calls, references and backward passes keep RSS flat and leave nothing behind") {
  const char* env = std::getenv("CORPC_SOAK_SECONDS");
  const auto duration = std::chrono::seconds(env ? std::atoi(env) : 16);
  run_world(
      kWorld,
      [&](int rank) {
        load_sanitizer_symbols();
        const auto start = std::chrono::steady_clock::now();
        const auto warm = start + duration / 4;
        std::int64_t after_warmup = 0, peak_after = 0;
        long rounds = 0;
        for (int i = 0; std::chrono::steady_clock::now() - start < duration; ++i) {
          const int a = (rank + 1 + i % (kWorld - 1)) % kWorld;                          // another worker
          const int b = (a + 1) % kWorld == rank ? (a + 2) % kWorld : (a + 1) % kWorld;  // a third one
          EXPECT_EQ(rpc_sync<&add>(a, i, 1), i + 1);
          {
            auto ref = remote<&make_tensor>(a, std::int64_t{256});
            EXPECT_EQ(rpc_sync<&sum_of>(b, ref), 256.0);  // forked to b, used there, dropped
          }
          {
            da::Context ctx;
            auto w = at::ones({64}).set_requires_grad(true);
            auto loss = rpc_sync<&times_three_sum>(a, w * 2);
            ctx.backward({loss}).wait(30s);
            EXPECT(at::allclose(ctx.gradients().at(w), at::full({64}, 6.0)));
          }
          ++rounds;
          if (i % 64 == 0) {
            const auto now = std::chrono::steady_clock::now();
            if (now >= warm && after_warmup == 0) after_warmup = rss_bytes();
            if (after_warmup) peak_after = std::max(peak_after, rss_bytes());
          }
        }
        // Flat: after the warm-up (allocator pools, caches and connections settle), growth stays within allocator
        // noise. A leak per round (a reference, a context, a connection buffer) grows with the rounds run and shows
        // above it.
        if (after_warmup) {
          const auto growth = peak_after - after_warmup;
          std::fprintf(stderr, "[soak rank %d] %ld rounds; RSS after warm-up %.1f MiB, peak later +%.1f MiB\n", rank,
                       rounds, after_warmup / 1048576.0, growth / 1048576.0);
          EXPECT(growth < after_warmup / 10 + (8 << 20));
        }
        // Checked once everyone has stopped creating references and contexts.
        if (rank != 0) return rpc_sync<&finished>(0);
        for (const auto until = std::chrono::steady_clock::now() + 60s; g_finished.load() < kWorld - 1;) {
          EXPECT(std::chrono::steady_clock::now() < until);
          std::this_thread::sleep_for(10ms);
        }
        {
          expect_no_references(kWorld);
          expect_no_contexts(kWorld);
        }
      },
      quick_options(), duration + 120s);
}

}  // namespace test_soak
