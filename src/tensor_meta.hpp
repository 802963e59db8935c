// The tensor table of a frame, as parsed from the wire: no tensor is allocated here, so this file needs no libtorch
// and is fuzzed on its own (tests/fuzz/fuzz_tensor_meta.cpp). src/tensor_wire.cpp turns each entry into a tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "corpc/wire/frame.hpp"

namespace corpc::detail {

inline constexpr std::uint8_t kTensorRequiresGrad = 1;
// The tensor is to be delivered on a CUDA device (its index follows the flags): the sender's device map chose it.
inline constexpr std::uint8_t kTensorOnDevice = 2;

struct TensorMeta {
  std::uint8_t dtype = 0;  // c10::ScalarType's value
  std::vector<std::int64_t> sizes, strides;
  bool requires_grad = false;
  std::int8_t device = -1;  // the CUDA device it is delivered on; -1: the CPU
  std::uint64_t nbytes = 0;
};

// What the parser must know about dtypes: the byte size of an element (0: not a dtype we accept) and whether a
// tensor of it may require grad. libtorch answers in tensor_wire.cpp; the fuzz target has its own table.
struct DtypeRules {
  std::size_t (*item_size)(std::uint8_t dtype);
  bool (*differentiable)(std::uint8_t dtype);
};

// Parses `num_tensors` entries and checks every size against the header's total and the limits, and every layout for
// density (strides that would make the receiver allocate more than the announced bytes are refused). Throws
// ProtocolError on anything malformed.
std::vector<TensorMeta> parse_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                          std::uint64_t total_bytes, const WireLimits& limits, DtypeRules rules);

}  // namespace corpc::detail
