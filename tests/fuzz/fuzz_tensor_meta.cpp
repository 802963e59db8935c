// libFuzzer target: the tensor table of a frame. Input: num_tensors (u32; its top bit: the receiver agreed to CUDA IPC)
// | total_bytes (u64) | metadata. Property: parse_tensor_meta throws ProtocolError or returns entries whose bytes in
// the frame add up to the header's total, each within the limits, each laid out densely, i.e. the storage
// empty_strided would allocate for it spans exactly its bytes; entries lent by CUDA IPC only where agreed, on a
// device, inside the allocation they name.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "corpc/wire/errors.hpp"

#include "wire/tensor_meta.hpp"

namespace {
// c10::ScalarType's element sizes in libtorch 1.13 (Byte .. QUInt2x4); anything else is refused like the real table.
std::size_t item_size(std::uint8_t dtype) {
  static constexpr std::uint8_t sizes[] = {1, 1, 2, 4, 8, 2, 4, 8, 4, 8, 16, 1, 1, 1, 4, 2, 1, 1};
  return dtype < sizeof sizes ? sizes[dtype] : 0;
}
bool differentiable(std::uint8_t dtype) { return (dtype >= 5 && dtype <= 10) || dtype == 15; }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 12) return 0;
  std::uint32_t num_tensors;
  std::uint64_t total;
  std::memcpy(&num_tensors, data, 4);
  std::memcpy(&total, data + 4, 8);
  const bool accept_ipc = num_tensors & 0x80000000u;
  num_tensors &= 0x7fffffffu;
  corpc::WireLimits limits;
  limits.max_dims = 8;
  std::vector<corpc::detail::TensorMeta> table;
  try {
    table = corpc::detail::parse_tensor_meta(reinterpret_cast<const char*>(data + 12), size - 12, num_tensors, total,
                                             limits, {&item_size, &differentiable}, accept_ipc);
  } catch (const corpc::ProtocolError&) {
    return 0;
  }
  if (table.size() != num_tensors) std::abort();
  std::uint64_t sum = 0;
  for (const auto& m : table) {
    if (m.sizes.size() != m.strides.size() || m.sizes.size() > limits.max_dims) std::abort();
    std::uint64_t numel = 1, span = 1;  // span: 1 + the largest element offset the strides reach
    for (std::size_t d = 0; d < m.sizes.size(); ++d) {
      numel *= static_cast<std::uint64_t>(m.sizes[d]);
      if (m.sizes[d] > 0) span += static_cast<std::uint64_t>(m.sizes[d] - 1) * static_cast<std::uint64_t>(m.strides[d]);
    }
    if (numel * item_size(m.dtype) != m.nbytes || m.nbytes > limits.max_tensor_bytes) std::abort();
    if (numel > 0 && span != numel) std::abort();  // dense: no gaps, no overlap, nothing beyond the announced bytes
    if (m.requires_grad && !differentiable(m.dtype)) std::abort();
    if (m.ipc && (!accept_ipc || m.device < 0 || m.ipc->offset > m.ipc->allocation_bytes ||
                  m.nbytes > m.ipc->allocation_bytes - m.ipc->offset || m.wire_bytes() != 0))
      std::abort();
    sum += m.wire_bytes();
  }
  if (sum != total) std::abort();
  return 0;
}
