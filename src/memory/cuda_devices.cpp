// The number of CUDA devices this process offers to RPC; tests may pretend to have some.
#include <atomic>

#include "memory/cuda_transfer.hpp"

namespace corpc::detail {

namespace {
std::atomic<int> g_test_device_count{-1};
}  // namespace

int local_cuda_device_count() {
  const int forced = g_test_device_count.load(std::memory_order_relaxed);
  return forced >= 0 ? forced : cuda::device_count();
}

void set_cuda_device_count_for_testing(int count) { g_test_device_count.store(count, std::memory_order_relaxed); }

}  // namespace corpc::detail
