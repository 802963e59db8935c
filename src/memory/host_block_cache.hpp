// Memory for large CPU tensors, kept for reuse. A fresh buffer of many megabytes is mapped by the kernel one page at
// a time as it is first written (a 64 MiB receive took ~16 thousand minor page faults), and glibc returns such buffers
// to the kernel as soon as they are freed, so a steady stream of same-sized tensors paid that on every message, and a
// training step paid it for every activation: on these VMs a page fault costs microseconds (ResNet50 at batch 48 of
// 128x128 images spent three quarters of its step in faults). Blocks here stay mapped while cached: a tensor's
// storage gives its block back when freed, and the next request of that size class gets pages that are already there.
//
// Two clients: received tensors (src/transport/tensor_frames.cpp) and, when installed, every large CPU allocation of the process
// (src/memory/host_allocator.cpp).
//
// Bounded: cached (free) blocks never exceed the cache limit; releasing past it unmaps the least recently used ones,
// and blocks idle for longer than kIdle are unmapped at the next acquire or release, so memory goes back once a
// workload stops. Blocks in use belong to their tensors and are not counted. Torch-free; process-wide, because
// tensors outlive the runtime that made them. Any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace corpc::detail {

class HostBlockCache {
 public:
  // Smaller requests use the ordinary allocator, whose heap is reused anyway.
  static constexpr std::size_t kMinBytes = std::size_t{1} << 20;
  // Long enough to span a slow training step: a block freed in one step's backward is wanted again in the next
  // step's forward, and ResNet50's steps at the pipeline tutorial's size took over 20 s on a loaded machine. Short
  // enough to give memory back soon after a workload stops.
  static constexpr std::chrono::seconds kIdle{60};

  static HostBlockCache& instance();  // never destroyed: tensors may be freed during static destruction

  // Page-aligned memory for at least `bytes`, or nullptr when caching is off (cache limit 0) or the size is below
  // kMinBytes. Throws std::bad_alloc when the memory cannot be mapped, even after dropping every cached block.
  void* acquire(std::size_t bytes);
  // Gives back memory that acquire returned and says its capacity; 0 (and nothing done) for any other pointer.
  std::size_t release(void* data) noexcept;

  void set_cache_limit(std::size_t bytes);  // 0: off (every cached block is unmapped)
  std::size_t cache_limit() const;
  std::size_t cached_bytes() const;

  // The capacity a request of `bytes` gets: pages, then four classes per power of two (at most 25% slack).
  static std::size_t size_class(std::size_t bytes) noexcept;

 private:
  struct Block {
    void* data;
    std::size_t capacity;  // its size class
    std::chrono::steady_clock::time_point released;
  };
  void trim_locked(std::size_t limit, std::vector<Block>& unmap);
  static void unmap(const std::vector<Block>& blocks) noexcept;

  mutable std::mutex mutex_;
  std::size_t limit_ = 0, cached_ = 0;
  std::vector<Block> cache_;                       // free, least recently released first
  std::unordered_map<void*, std::size_t> in_use_;  // data -> capacity
};

}  // namespace corpc::detail
