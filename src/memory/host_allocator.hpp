// The CPU tensor allocator corpc puts in front of libtorch's (c10::SetCPUAllocator), for two reasons:
// - large allocations (HostBlockCache::kMinBytes and more) come from the block cache, so a training step's activations
//   and gradients reuse mapped pages instead of faulting fresh ones in on every step (the jemalloc/tcmalloc advice
//   of PyTorch's CPU performance guides, for the sizes where it matters, bounded and without a preload);
// - it counts the bytes it has handed out, for the pipeline's peak-activation figure (libtorch's CPU allocator keeps
//   no statistics).
// Smaller allocations go to the allocator that was current when this one was installed. Installed at most once per
// process and never removed: tensors outlive runtimes. Any thread.
#pragma once

#include <cstdint>
#include <optional>

#include "corpc/memory/host_memory.hpp"

namespace corpc::detail {

// Installs the allocator (idempotent).
void install_host_allocator();
// What init_rpc and ddp::init_process_group do: HostMemoryOptions' defaults, unless configure_host_memory ran.
void configure_host_memory_defaults();
// Whether large allocations come from the block cache (initially not; configure_host_memory sets it). A block cache
// limit of 0 turns it off as well.
void cache_large_host_allocations(bool on);

// The bytes it has handed out and not yet taken back: the request for small allocations (as malloc_usable_size
// reports it), the size class for cached blocks. Allocations made before it was installed are not counted (their
// DataPtrs free them without it).
std::int64_t host_live_bytes();
std::int64_t host_peak_bytes();
void reset_host_peak_bytes();  // the peak starts again from what is live now

}  // namespace corpc::detail
