// Memory for large received tensors, kept for reuse. A fresh buffer of many megabytes is mapped by the kernel one
// page at a time as the socket writes into it (a 64 MiB receive took ~16 thousand minor page faults), and glibc
// returns such buffers to the kernel as soon as they are freed, so a steady stream of same-sized tensors paid that on
// every message. Blocks here stay mapped while cached: a tensor received into one gives it back when its storage is
// freed, and the next receive of that size class writes into pages that are already there.
//
// Bounded: cached (free) blocks never exceed `cache_limit` bytes; releasing past it unmaps the least recently used
// ones, and blocks idle for longer than kIdle are unmapped at the next acquire or release, so memory goes back once a
// stream stops. Blocks in use belong to their tensors and are not counted (the receive budget bounds what requests
// hold). Torch-free; process-wide, because tensors outlive the runtime that received them. Any thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace corpc::detail {

class ReceivePool {
 public:
  // Smaller receives use the ordinary allocator, whose heap is reused anyway.
  static constexpr std::size_t kMinBytes = std::size_t{1} << 20;
  static constexpr std::chrono::seconds kIdle{10};

  struct Block {
    void* data;
    std::size_t capacity;  // its size class
    std::chrono::steady_clock::time_point released;
  };

  static ReceivePool& instance();  // never destroyed: tensors may be freed during static destruction

  // A block of at least `bytes`, or nullptr when pooling is off (cache_limit 0) or the size is below kMinBytes.
  // Throws std::bad_alloc when the memory cannot be mapped.
  Block* acquire(std::size_t bytes);
  void release(Block* block) noexcept;

  void set_cache_limit(std::size_t bytes);  // 0: off (every cached block is unmapped)
  std::size_t cached_bytes() const;

  // The capacity a request of `bytes` gets: pages, then four classes per power of two (at most 25% slack).
  static std::size_t size_class(std::size_t bytes) noexcept;

 private:
  void trim_locked(std::size_t limit, std::vector<Block*>& unmap);
  static void unmap(const std::vector<Block*>& blocks) noexcept;

  mutable std::mutex mutex_;
  std::size_t limit_ = 0, cached_ = 0;
  std::vector<Block*> cache_;  // least recently released first
};

}  // namespace corpc::detail
