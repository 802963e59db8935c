// The tensor table of a frame, as parsed from the wire: no tensor is allocated here, so this file needs no libtorch
// and is fuzzed on its own (tests/fuzz/fuzz_tensor_meta.cpp). src/transport/tensor_frames.cpp turns each entry into a tensor.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "corpc/wire/limits.hpp"

namespace corpc::detail {

inline constexpr std::uint8_t kTensorRequiresGrad = 1;
// The tensor is to be delivered on a CUDA device (its index follows the flags): the sender's device map chose it.
inline constexpr std::uint8_t kTensorOnDevice = 2;
// The tensor's bytes are not in the frame: the sender lends its device memory by CUDA IPC (src/memory/cuda_ipc.hpp), and a
// CudaIpcRef follows the byte count. Only with kTensorOnDevice, and only between workers that agreed to it.
inline constexpr std::uint8_t kTensorCudaIpc = 4;

// CUDA_IPC_HANDLE_SIZE: cudaIpcMemHandle_t and cudaIpcEventHandle_t are opaque blocks of this many bytes.
inline constexpr std::size_t kCudaIpcHandleBytes = 64;
using CudaIpcHandle = std::array<char, kCudaIpcHandleBytes>;

// Where a tensor lent by CUDA IPC is: what the receiver needs to copy it out of the sender's memory.
struct CudaIpcRef {
  std::uint64_t id = 0;                // the sender's loan, named in the receiver's IpcDone frame
  CudaIpcHandle memory{};              // cudaIpcMemHandle_t of the allocation (a caching-allocator segment)
  std::uint64_t offset = 0;            // of the tensor's first byte from the allocation's base
  std::uint64_t allocation_bytes = 0;  // the allocation's size: offset + the tensor's bytes must lie within it
  CudaIpcHandle event{};               // cudaIpcEventHandle_t, recorded on the producer's stream after the tensor
};

struct TensorMeta {
  std::uint8_t dtype = 0;  // c10::ScalarType's value
  std::vector<std::int64_t> sizes, strides;
  bool requires_grad = false;
  std::int8_t device = -1;  // the CUDA device it is delivered on; -1: the CPU
  std::uint64_t nbytes = 0;
  std::optional<CudaIpcRef> ipc;  // lent by CUDA IPC: nbytes is the tensor's size, none of it is in the frame
  // Bytes of this tensor in the frame (what the header's tensor_bytes adds up).
  std::uint64_t wire_bytes() const noexcept { return ipc ? 0 : nbytes; }
};

// What the parser must know about dtypes: the byte size of an element (0: not a dtype we accept) and whether a
// tensor of it may require grad. libtorch answers in tensor_wire.cpp; the fuzz target has its own table.
struct DtypeRules {
  std::size_t (*item_size)(std::uint8_t dtype);
  bool (*differentiable)(std::uint8_t dtype);
};

// Parses `num_tensors` entries and checks every size against the header's total and the limits, and every layout for
// density (strides that would make the receiver allocate more than the announced bytes are refused). Entries lent by
// CUDA IPC are accepted only with `accept_cuda_ipc` (the pair agreed to it in the handshake): a receiver that did
// not agree cannot map them, and a peer that sends them anyway is broken. Throws ProtocolError on anything malformed.
std::vector<TensorMeta> parse_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                          std::uint64_t total_bytes, const WireLimits& limits, DtypeRules rules,
                                          bool accept_cuda_ipc = false);

// Appends the CudaIpcRef of an entry flagged kTensorCudaIpc (after its byte count), as parse_tensor_meta reads it.
void write_cuda_ipc_ref(std::string& meta, const CudaIpcRef& ref);

}  // namespace corpc::detail
