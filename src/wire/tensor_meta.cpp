// Parsing and checking the tensor table of a frame (see tensor_meta.hpp); torch-free.
#include "wire/tensor_meta.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "corpc/wire/codec.hpp"

namespace corpc::detail {

namespace {
// True if `strides` lay out `sizes` densely without overlap (some permutation of a contiguous layout). Checked before
// allocating: empty_strided sizes its storage from the strides, so hostile strides could ask for any amount.
bool dense_layout(const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of the dims that matter
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) return true;  // no elements: nothing is allocated
    if (sizes[i] > 1) dims.emplace_back(strides[i], sizes[i]);
  }
  std::sort(dims.begin(), dims.end());
  std::uint64_t expected = 1;  // the product of the sizes so far, checked against overflow by the caller
  for (auto [stride, size] : dims) {
    if (stride < 0 || static_cast<std::uint64_t>(stride) != expected) return false;
    expected *= static_cast<std::uint64_t>(size);
  }
  return true;
}
}  // namespace

void write_cuda_ipc_ref(std::string& meta, const CudaIpcRef& ref) {
  Writer w(meta);
  w.put(ref.id);
  w.raw(ref.memory.data(), ref.memory.size());
  w.put(ref.offset);
  w.put(ref.allocation_bytes);
  w.raw(ref.event.data(), ref.event.size());
}

namespace {
CudaIpcRef read_cuda_ipc_ref(Reader& r, std::uint64_t nbytes) {
  CudaIpcRef ref;
  ref.id = r.get<std::uint64_t>();
  r.raw(ref.memory.data(), ref.memory.size());
  ref.offset = r.get<std::uint64_t>();
  ref.allocation_bytes = r.get<std::uint64_t>();
  r.raw(ref.event.data(), ref.event.size());
  // The receiver copies [offset, offset + nbytes) of the mapped allocation: nothing outside it may be named.
  if (ref.offset > ref.allocation_bytes || nbytes > ref.allocation_bytes - ref.offset)
    throw ProtocolError("CUDA IPC tensor of " + std::to_string(nbytes) + " bytes at offset " +
                        std::to_string(ref.offset) + " outside its allocation of " +
                        std::to_string(ref.allocation_bytes));
  return ref;
}
}  // namespace

std::vector<TensorMeta> parse_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                          std::uint64_t total_bytes, const WireLimits& limits, DtypeRules rules,
                                          bool accept_cuda_ipc) {
  Reader r(meta, meta_len);
  std::vector<TensorMeta> out;
  // Each entry takes at least 11 bytes: a hostile count cannot reserve more than the metadata could hold.
  out.reserve(std::min<std::size_t>(num_tensors, meta_len / 11));
  std::uint64_t sum = 0;
  for (std::uint32_t i = 0; i < num_tensors; ++i) {
    TensorMeta m;
    m.dtype = r.get<std::uint8_t>();
    const std::uint64_t item = rules.item_size(m.dtype);
    if (item == 0) throw ProtocolError("unknown tensor dtype " + std::to_string(m.dtype));
    auto dim = r.get<std::uint8_t>();
    if (dim > limits.max_dims) throw ProtocolError("tensor with " + std::to_string(dim) + " dimensions");
    r.need(std::size_t{dim} * 16);
    m.sizes.resize(dim);
    m.strides.resize(dim);
    for (auto& s : m.sizes) s = r.get<std::int64_t>();
    for (auto& s : m.strides) s = r.get<std::int64_t>();
    const auto flags = r.get<std::uint8_t>();
    if (flags & ~(kTensorRequiresGrad | kTensorOnDevice | kTensorCudaIpc))
      throw ProtocolError("unknown tensor flags " + std::to_string(flags));
    if ((flags & kTensorCudaIpc) && !(flags & kTensorOnDevice))
      throw ProtocolError("a CUDA IPC tensor without its device");
    if ((flags & kTensorCudaIpc) && !accept_cuda_ipc)
      throw ProtocolError("a CUDA IPC tensor from a peer that did not agree to CUDA IPC");
    if (flags & kTensorOnDevice) {
      m.device = r.get<std::int8_t>();
      if (m.device < 0) throw ProtocolError("CUDA device index " + std::to_string(m.device));
    }
    m.nbytes = r.get<std::uint64_t>();
    if (flags & kTensorCudaIpc) m.ipc = read_cuda_ipc_ref(r, m.nbytes);
    // numel from sizes, with overflow checks, must match the announced byte count.
    std::uint64_t numel = 1;
    for (auto s : m.sizes) {
      if (s < 0) throw ProtocolError("negative tensor size");
      if (s != 0 && numel > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(s))
        throw ProtocolError("tensor size overflows");
      numel *= static_cast<std::uint64_t>(s);
    }
    if (numel > limits.max_tensor_bytes / item || numel * item != m.nbytes)
      throw ProtocolError("tensor byte count mismatch");
    sum += m.wire_bytes();
    if (sum > total_bytes) throw ProtocolError("tensor bytes exceed the frame's total");
    if (!dense_layout(m.sizes, m.strides)) throw ProtocolError("tensor strides do not describe a dense layout");
    m.requires_grad = flags & kTensorRequiresGrad;
    if (m.requires_grad && !rules.differentiable(m.dtype)) throw ProtocolError("requires_grad on a non-float tensor");
    out.push_back(std::move(m));
  }
  if (sum != total_bytes) throw ProtocolError("tensor bytes do not add up to the frame's total");
  if (r.remaining() != 0) throw ProtocolError("trailing bytes in tensor metadata");
  return out;
}

}  // namespace corpc::detail
