/// @file
/// Where large CPU tensors live: mapped blocks kept for reuse, for the whole process.
///
/// A fresh large buffer is faulted in page by page, and on a VM a page fault costs microseconds (ResNet50's training
/// step on CPU spent most of its time there). So large CPU tensors (1 MiB and more) — received ones, and by default
/// every one the process allocates — live in mapped blocks that are kept for reuse when freed: a steady workload maps
/// no new pages. The cache is the process's, as libtorch's CPU allocator is, so it is configured for the process:
/// ```cpp
///   corpc::configure_host_memory({.cache_bytes = 8ull << 30});  // before init_rpc / init_process_group, or any time
/// ```
/// Without a call, the first init_rpc or ddp::init_process_group applies the defaults below.
#pragma once

#include <cstdint>
#include <optional>

namespace corpc {

/// How the process keeps large CPU blocks (corpc/memory/host_memory.hpp).
struct HostMemoryOptions {
  /// The most memory kept in freed blocks for reuse. The least recently used go first, blocks idle for 60 s are
  /// unmapped, and all of them when memory runs out. Unset: a quarter of physical memory. 0: no cache (fresh memory
  /// from libtorch's allocator every time).
  std::optional<std::uint64_t> cache_bytes;
  /// Whether every large CPU allocation of the process uses the blocks, not only received tensors: an allocator is
  /// installed in front of libtorch's (c10::SetCPUAllocator; it stays for the life of the process, since tensors
  /// outlive any runtime). false: only received tensors.
  bool cache_cpu_allocations = true;
};

/// Configures the host block cache for the whole process; the latest call holds. Any thread, any time: blocks in use
/// stay where they are, and the new settings apply from the next allocation.
void configure_host_memory(const HostMemoryOptions& options);

}  // namespace corpc
