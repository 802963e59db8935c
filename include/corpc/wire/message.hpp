// corpc/wire/message.hpp — one framed message as the RPC layer sees it: a kind, an id, an encoded body and tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "corpc/wire/frame.hpp"

namespace corpc {

struct Message {
  FrameKind kind = FrameKind::Request;
  std::uint64_t id = 0;
  std::uint16_t flags = 0;           // kFlag* below
  std::string body;                  // codec bytes; tensors appear in it as indices into `tensors`
  std::vector<at::Tensor> tensors;   // sent out of band
};

// A request that is corpc's own shutdown bookkeeping: not counted as work in flight.
inline constexpr std::uint16_t kFlagControl = 1;

// Encodes a tensor table into `meta` and returns the tensors whose storage will be sent as they are: dense tensors
// go from their own storage (their strides preserved), others are made contiguous first (only their elements travel),
// non-CPU tensors are copied to the CPU.
std::vector<at::Tensor> encode_tensor_meta(const std::vector<at::Tensor>& tensors, std::string& meta,
                                           std::uint64_t& total_bytes);

// Decodes a tensor table and allocates an empty tensor for each entry, checking every size against the header and
// the limits first. The caller reads each tensor's bytes into `data_ptr()`.
std::vector<at::Tensor> decode_tensor_meta(const std::string& meta, std::uint32_t num_tensors,
                                           std::uint64_t total_bytes, const WireLimits& limits);

}  // namespace corpc
