#include "memory/host_allocator.hpp"

#include <c10/core/CPUAllocator.h>
#include <malloc.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <new>

#include "corpc/detail/torch_compat.hpp"

#include "memory/host_block_cache.hpp"

namespace corpc::detail {
namespace {

std::atomic<bool> caching{false};
std::atomic<std::int64_t> live{0}, peak{0};

void add(std::int64_t bytes) {
  const auto now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  auto seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {}
}
void sub(std::int64_t bytes) { live.fetch_sub(bytes, std::memory_order_relaxed); }

// Every pointer it hands out has context == data and the counts balance whichever way it is freed: through its
// DataPtr, or through raw_deallocate (oneDNN's scratch buffers take that route).
class HostAllocator final : public CpuAllocatorBase<> {
 public:
  explicit HostAllocator(c10::Allocator* inner) : inner_(inner), inner_deleter_(inner->raw_deleter()) {}

  c10::DataPtr allocate_bytes(size_t n) const override {
    void* block = nullptr;
    if (n >= HostBlockCache::kMinBytes && caching.load(std::memory_order_relaxed)) {
      // Out of memory even after the cache dropped its blocks: the previous allocator tries, and fails with the
      // error libtorch users expect (c10::Error, "can't allocate memory"), not a bare std::bad_alloc.
      try {
        block = HostBlockCache::instance().acquire(n);
      } catch (const std::bad_alloc&) {}
    }
    if (block) {
      add(static_cast<std::int64_t>(HostBlockCache::size_class(n)));
      return {block, block, &release_block, c10::Device(c10::kCPU)};
    }
    c10::DataPtr p = inner_->allocate(n);
    void* data = p.get();
    // The previous allocator's own layout (context != data) cannot be freed through its raw deleter: left as it is,
    // uncounted.
    if (!data || !inner_deleter_ || p.get_context() != data) return p;
    p.release_context();
    add(static_cast<std::int64_t>(::malloc_usable_size(data)));
    return {data, data, &release_small, p.device()};
  }
  c10::DeleterFnPtr raw_deleter() const override { return inner_deleter_ ? &release_any : nullptr; }
  void copy_bytes(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  static inline HostAllocator* instance = nullptr;

 private:
  static void release_block(void* data) { sub(static_cast<std::int64_t>(HostBlockCache::instance().release(data))); }
  static void release_small(void* data) {
    sub(static_cast<std::int64_t>(::malloc_usable_size(data)));
    instance->inner_deleter_(data);
  }
  // Only raw frees need to find out which kind a pointer is (a lookup under the cache's lock).
  static void release_any(void* data) {
    if (const std::size_t capacity = HostBlockCache::instance().release(data)) sub(static_cast<std::int64_t>(capacity));
    else release_small(data);
  }

  c10::Allocator* inner_;
  c10::DeleterFnPtr inner_deleter_;
};

}  // namespace

void install_host_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    HostAllocator::instance = new HostAllocator(c10::GetCPUAllocator());  // lives as long as tensors
    c10::SetCPUAllocator(HostAllocator::instance, /*priority=*/1);
  });
}

namespace {
std::once_flag configured;  // by the user, or with the defaults
void apply(const HostMemoryOptions& options) {
  const std::uint64_t quarter_of_memory =
      static_cast<std::uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)) / 4;
  HostBlockCache::instance().set_cache_limit(static_cast<std::size_t>(options.cache_bytes.value_or(quarter_of_memory)));
  if (options.cache_cpu_allocations) install_host_allocator();
  cache_large_host_allocations(options.cache_cpu_allocations);
}
}  // namespace

void configure_host_memory_defaults() {
  std::call_once(configured, [] { apply({}); });
}

void cache_large_host_allocations(bool on) { caching.store(on, std::memory_order_relaxed); }
std::int64_t host_live_bytes() { return live.load(std::memory_order_relaxed); }
std::int64_t host_peak_bytes() { return peak.load(std::memory_order_relaxed); }
void reset_host_peak_bytes() { peak.store(live.load(std::memory_order_relaxed), std::memory_order_relaxed); }

}  // namespace corpc::detail

namespace corpc {

void configure_host_memory(const HostMemoryOptions& options) {
  std::call_once(detail::configured, [] {});  // the defaults are not applied over this
  detail::apply(options);
}

}  // namespace corpc
