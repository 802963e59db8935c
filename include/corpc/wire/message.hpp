/// @file
/// One framed message as the RPC layer sees it: a typed header, an encoded body and tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "corpc/wire/frame.hpp"

namespace corpc {

/// A message as the RPC layer builds and receives it: header fields, codec bytes and the tensors they refer to.
struct Message {
  FrameHeader head;                 ///< kind, ids, flags; the lengths are filled in when the message is prepared
  std::string body;                 ///< codec bytes; tensors appear in it as indices into `tensors`
  std::vector<at::Tensor> tensors;  ///< sent out of band
};

/// A message ready for the socket: its tensor metadata encoded, its tensors in the form their bytes are sent in.
/// Preparing is the step that can fail (a sparse tensor, a failed copy off a device): it happens before a call is
/// counted or registered anywhere, so such a failure touches nothing but that call.
struct OutFrame {
  FrameHeader head;                 ///< complete, lengths included
  std::string meta;                 ///< the encoded tensor table
  std::string body;                 ///< codec bytes
  std::vector<at::Tensor> tensors;  ///< dense CPU tensors whose storage is sent as it is
  /// Bytes this frame occupies on the wire.
  std::uint64_t wire_bytes() const noexcept { return sizeof head + meta.size() + body.size() + head.tensor_bytes; }
};
/// Encodes `msg`'s tensor table and fills in the header's lengths. Throws UsageError for a sparse or quantized
/// tensor, MessageTooLargeError for a body or table over 4 GiB, torch's error if a copy off a device fails.
OutFrame prepare(Message&& msg);
/// Throws MessageTooLargeError if the receiver (whose limits are `limits`) would refuse `f`.
void check_limits(const OutFrame& f, const WireLimits& limits, const std::string& receiver);
/// Throws MessageTooLargeError if `f`, a request, is over the receiver's budget for received requests.
void check_request_budget(const OutFrame& f, const WireLimits& limits, const std::string& receiver);

/// Encodes a tensor table into `meta` and returns the tensors whose storage will be sent as they are: dense tensors
/// go from their own storage (their strides preserved), others are made contiguous first (only their elements travel),
/// non-CPU tensors are copied to the CPU.
std::vector<at::Tensor> encode_tensor_meta(const std::vector<at::Tensor>& tensors, std::string& meta,
                                           std::uint64_t& total_bytes);

/// Decodes a tensor table and allocates an empty tensor for each entry, checking every size against the header and
/// the limits first. The caller reads each tensor's bytes into `data_ptr()`.
std::vector<at::Tensor> decode_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                           std::uint64_t total_bytes, const WireLimits& limits);

}  // namespace corpc
