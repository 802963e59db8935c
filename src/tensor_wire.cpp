// Tensor metadata on the wire: dtype, shape, strides and requires_grad per tensor; the bytes travel separately.
#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "corpc/wire/codec.hpp"
#include "corpc/wire/message.hpp"

namespace corpc {

namespace {
constexpr std::uint8_t kRequiresGrad = 1;

// Bytes spanned by a non-overlapping, dense layout: exactly numel * itemsize, starting at data_ptr().
std::uint64_t dense_bytes(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }

// True if `strides` lay out `sizes` densely without overlap (some permutation of a contiguous layout). Checked before
// allocating: empty_strided sizes its storage from the strides, so hostile strides could ask for any amount.
bool dense_layout(const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of the dims that matter
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) return true;  // no elements: nothing is allocated
    if (sizes[i] > 1) dims.emplace_back(strides[i], sizes[i]);
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t expected = 1;
  for (auto [stride, size] : dims) {
    if (stride != expected) return false;
    expected *= size;
  }
  return true;
}
}  // namespace

std::vector<at::Tensor> encode_tensor_meta(const std::vector<at::Tensor>& tensors, std::string& meta,
                                           std::uint64_t& total_bytes) {
  std::vector<at::Tensor> wire;
  wire.reserve(tensors.size());
  Writer w(meta);
  total_bytes = 0;
  for (const auto& original : tensors) {
    at::Tensor t = original;
    if (t.is_sparse() || t.is_quantized()) throw UsageError("corpc sends dense tensors only");
    if (!t.device().is_cpu()) t = t.to(at::kCPU);
    // Dense layouts (contiguous, transposed, channels-last...) go as they are; views with gaps send their elements.
    if (!t.is_non_overlapping_and_dense()) t = t.contiguous();
    w.put(static_cast<std::uint8_t>(t.scalar_type()));
    w.put(static_cast<std::uint8_t>(t.dim()));
    for (auto s : t.sizes()) w.put(static_cast<std::int64_t>(s));
    for (auto s : t.strides()) w.put(static_cast<std::int64_t>(s));
    w.put(static_cast<std::uint8_t>(original.requires_grad() ? kRequiresGrad : 0));
    std::uint64_t n = dense_bytes(t);
    w.put(n);
    total_bytes += n;
    wire.push_back(t.detach());
  }
  return wire;
}

std::vector<at::Tensor> decode_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                           std::uint64_t total_bytes, const WireLimits& limits) {
  Reader r(meta, meta_len);
  std::vector<at::Tensor> out;
  out.reserve(num_tensors);
  std::uint64_t sum = 0;
  for (std::uint32_t i = 0; i < num_tensors; ++i) {
    auto dtype_raw = r.get<std::uint8_t>();
    if (dtype_raw >= static_cast<std::uint8_t>(at::ScalarType::NumOptions) ||
        dtype_raw == static_cast<std::uint8_t>(at::ScalarType::Undefined))
      throw ProtocolError("unknown tensor dtype " + std::to_string(dtype_raw));
    auto dtype = static_cast<at::ScalarType>(dtype_raw);
    auto dim = r.get<std::uint8_t>();
    if (dim > limits.max_dims) throw ProtocolError("tensor with " + std::to_string(dim) + " dimensions");
    std::vector<std::int64_t> sizes(dim), strides(dim);
    for (auto& s : sizes) s = r.get<std::int64_t>();
    for (auto& s : strides) s = r.get<std::int64_t>();
    auto flags = r.get<std::uint8_t>();
    auto nbytes = r.get<std::uint64_t>();
    // numel from sizes, with overflow checks, must match the announced byte count.
    std::uint64_t numel = 1;
    for (auto s : sizes) {
      if (s < 0) throw ProtocolError("negative tensor size");
      if (s != 0 && numel > std::numeric_limits<std::uint64_t>::max() / static_cast<std::uint64_t>(s))
        throw ProtocolError("tensor size overflows");
      numel *= static_cast<std::uint64_t>(s);
    }
    const std::uint64_t item = c10::elementSize(dtype);
    if (numel > limits.max_tensor_bytes / item || numel * item != nbytes) throw ProtocolError("tensor byte count mismatch");
    sum += nbytes;
    if (sum > total_bytes) throw ProtocolError("tensor bytes exceed the frame's total");
    if (!dense_layout(sizes, strides)) throw ProtocolError("tensor strides do not describe a dense layout");
    at::Tensor t = at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
    if (flags & kRequiresGrad) {
      if (!at::isFloatingType(dtype) && !at::isComplexType(dtype)) throw ProtocolError("requires_grad on a non-float tensor");
      t.set_requires_grad(true);
    }
    out.push_back(std::move(t));
  }
  if (sum != total_bytes) throw ProtocolError("tensor bytes do not add up to the frame's total");
  if (r.remaining() != 0) throw ProtocolError("trailing bytes in tensor metadata");
  return out;
}

OutFrame prepare(Message&& msg) {
  OutFrame f;
  f.head = msg.head;
  std::uint64_t total = 0;
  if (!msg.tensors.empty()) f.tensors = encode_tensor_meta(msg.tensors, f.meta, total);
  f.head.meta_len = static_cast<std::uint32_t>(f.meta.size());
  f.head.body_len = static_cast<std::uint32_t>(msg.body.size());
  f.head.num_tensors = static_cast<std::uint32_t>(f.tensors.size());
  f.head.tensor_bytes = total;
  f.body = std::move(msg.body);
  // Checked here, against our own limits' hard ceiling, so that no length is ever truncated by the 32-bit fields.
  if (f.body.size() > std::numeric_limits<std::uint32_t>::max() || f.meta.size() > std::numeric_limits<std::uint32_t>::max())
    throw MessageTooLargeError("message body of " + std::to_string(f.body.size()) + " bytes cannot be framed (4 GiB at most)");
  return f;
}

void check_request_budget(const OutFrame& f, const WireLimits& lim, const std::string& receiver) {
  const std::uint64_t n = f.wire_bytes();
  if (n > lim.max_request_bytes)
    throw MessageTooLargeError("a request of " + std::to_string(n) + " bytes is over the " +
                               std::to_string(lim.max_request_bytes) + " that worker '" + receiver +
                               "' may hold (its RpcOptions::receive_budget_per_connection / _per_process)");
}

void check_limits(const OutFrame& f, const WireLimits& lim, const std::string& receiver) {
  auto refuse = [&](const std::string& what, std::uint64_t n, std::uint64_t limit) {
    throw MessageTooLargeError(what + " of " + std::to_string(n) + " bytes is over the " + std::to_string(limit) +
                               " that worker '" + receiver + "' accepts (its RpcOptions::limits)");
  };
  if (f.body.size() > lim.max_body_bytes) refuse("message body", f.body.size(), lim.max_body_bytes);
  if (f.meta.size() > lim.max_meta_bytes) refuse("tensor metadata", f.meta.size(), lim.max_meta_bytes);
  if (f.tensors.size() > lim.max_tensors)
    throw MessageTooLargeError(std::to_string(f.tensors.size()) + " tensors are more than worker '" + receiver +
                               "' accepts in one message (" + std::to_string(lim.max_tensors) + ")");
  if (f.head.tensor_bytes > lim.max_tensor_bytes) refuse("tensor data", f.head.tensor_bytes, lim.max_tensor_bytes);
  for (const auto& t : f.tensors)
    if (static_cast<std::uint32_t>(t.dim()) > lim.max_dims)
      throw MessageTooLargeError("a tensor of " + std::to_string(t.dim()) + " dimensions is more than worker '" +
                                 receiver + "' accepts");
}

}  // namespace corpc
