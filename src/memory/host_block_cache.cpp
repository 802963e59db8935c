#include "memory/host_block_cache.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <new>

namespace corpc::detail {

HostBlockCache& HostBlockCache::instance() {
  static auto* cache = new HostBlockCache;  // leaked on purpose (see the header)
  return *cache;
}

std::size_t HostBlockCache::size_class(std::size_t bytes) noexcept {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  bytes = (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
  const std::size_t step = std::max(page, std::bit_floor(bytes) / 4);
  return (bytes + step - 1) / step * step;
}

void* HostBlockCache::acquire(std::size_t bytes) {
  if (bytes < kMinBytes) return nullptr;
  const std::size_t capacity = size_class(bytes);
  std::vector<Block> stale;
  void* found = nullptr;
  {
    std::lock_guard lock(mutex_);
    if (limit_ == 0) return nullptr;
    // The most recently released block of this class: its pages are the likeliest to be resident.
    for (auto it = cache_.rbegin(); it != cache_.rend(); ++it)
      if (it->capacity == capacity) {
        found = it->data;
        cache_.erase(std::next(it).base());
        cached_ -= capacity;
        in_use_.emplace(found, capacity);
        break;
      }
    trim_locked(limit_, stale);
  }
  unmap(stale);
  if (found) return found;
  void* p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    // Under memory pressure the cache goes first.
    {
      std::lock_guard lock(mutex_);
      trim_locked(0, stale);
    }
    unmap(stale);
    p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
  }
  // Huge pages where the system allows them on request: 512 times fewer faults on first use.
  ::madvise(p, capacity, MADV_HUGEPAGE);
  try {
    std::lock_guard lock(mutex_);
    in_use_.emplace(p, capacity);
  } catch (...) {
    ::munmap(p, capacity);
    throw;
  }
  return p;
}

std::size_t HostBlockCache::release(void* data) noexcept {
  std::vector<Block> stale;
  std::size_t capacity = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = in_use_.find(data);
    if (it == in_use_.end()) return 0;
    capacity = it->second;
    in_use_.erase(it);
    try {
      cache_.push_back(Block{data, capacity, std::chrono::steady_clock::now()});
      cached_ += capacity;
    } catch (...) {  // no room to remember it: give it back to the kernel
      stale.push_back(Block{data, capacity, {}});
    }
    trim_locked(limit_, stale);
  }
  unmap(stale);
  return capacity;
}

void HostBlockCache::set_cache_limit(std::size_t bytes) {
  std::vector<Block> stale;
  {
    std::lock_guard lock(mutex_);
    limit_ = bytes;
    trim_locked(limit_, stale);
  }
  unmap(stale);
}

std::size_t HostBlockCache::cache_limit() const {
  std::lock_guard lock(mutex_);
  return limit_;
}

std::size_t HostBlockCache::cached_bytes() const {
  std::lock_guard lock(mutex_);
  return cached_;
}

// Takes out, oldest first, blocks over the limit and blocks idle for longer than kIdle.
void HostBlockCache::trim_locked(std::size_t limit, std::vector<Block>& unmap) {
  const auto idle_since = std::chrono::steady_clock::now() - kIdle;
  std::size_t n = 0;
  while (n < cache_.size() && (cached_ > limit || cache_[n].released < idle_since)) {
    cached_ -= cache_[n].capacity;
    unmap.push_back(cache_[n++]);
  }
  cache_.erase(cache_.begin(), cache_.begin() + static_cast<std::ptrdiff_t>(n));
}

void HostBlockCache::unmap(const std::vector<Block>& blocks) noexcept {
  for (const Block& b : blocks) ::munmap(b.data, b.capacity);
}

}  // namespace corpc::detail
