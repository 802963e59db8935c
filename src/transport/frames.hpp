// A message as the transport frames it (corpc/wire/detail/message.hpp holds the message itself): its tensor table
// encoded, its tensors in the form their bytes are sent in, and the checks against what the receiver accepts.
// Defined in tensor_frames.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/wire/detail/message.hpp"
#include "corpc/wire/device_map.hpp"
#include "corpc/wire/limits.hpp"

namespace corpc::detail {

class DeviceTransfer;
class CudaIpcLink;
class CudaIpcLoans;

// A message ready for the socket: its tensor metadata encoded, its tensors in the form their bytes are sent in.
// Preparing is the step that can fail (a sparse tensor, a failed copy off a device): it happens before a call is
// counted or registered anywhere, so such a failure touches nothing but that call.
struct OutFrame {
  FrameHeader head;                 // complete, lengths included
  std::string meta;                 // the encoded tensor table
  std::string body;                 // codec bytes
  std::vector<at::Tensor> tensors;  // dense CPU tensors whose storage is sent as it is
  // Set while CUDA tensors are being copied into `tensors` (pinned host memory): the frame may be written only once
  // that completes (the runtime defers it; no thread waits).
  std::shared_ptr<DeviceTransfer> staged;
  // Set when CUDA tensors are lent to the receiver by CUDA IPC (their entries in `tensors` are empty placeholders):
  // the loans are returned if the frame is dropped before the connection takes it.
  std::shared_ptr<CudaIpcLoans> lent;
  // The sender blocks on this frame's reply next (rpc_sync): it leaves at once, never held back to be coalesced with
  // the sender's next frames. Not on the wire.
  bool send_now = false;
  // Bytes this frame occupies on the wire.
  std::uint64_t wire_bytes() const noexcept { return sizeof head + meta.size() + body.size() + head.tensor_bytes; }
};
// Encodes `msg`'s tensor table and fills in the header's lengths. CUDA tensors go to the devices `map` (the device
// map to the receiver, named `receiver` in errors) gives them; lent by CUDA IPC when `ipc` (the connection's link,
// agreed with the receiver) still lends, staged through host memory otherwise. Throws UsageError for a sparse or
// quantized tensor or a CUDA tensor that `map` has no entry for, MessageTooLargeError for a body or table over 4 GiB,
// torch's error if a copy off a device fails.
OutFrame prepare(Message&& msg, const DeviceMap& map = {}, std::string_view receiver = {},
                 const std::shared_ptr<CudaIpcLink>& ipc = nullptr);
// Throws MessageTooLargeError if the receiver (whose limits are `limits`) would refuse `f`.
void check_limits(const OutFrame& f, const WireLimits& limits, const std::string& receiver);
// Throws MessageTooLargeError if `f`, a request, is over the receiver's budget for received requests.
void check_request_budget(const OutFrame& f, const WireLimits& limits, const std::string& receiver);

// Encodes a tensor table into `meta` and returns the tensors whose storage will be sent as they are: dense tensors
// go from their own storage (their strides preserved), others are made contiguous first (only their elements travel),
// CUDA tensors are lent by CUDA IPC (with `ipc`; their loans are added to `*lent`, and an empty placeholder stands
// in the result) or staged into pinned host memory (`staged` is set then), and delivered on the device `map` gives
// them, tensors on other devices are copied to the CPU.
std::vector<at::Tensor> encode_tensor_meta(const std::vector<at::Tensor>& tensors, std::string& meta,
                                           std::uint64_t& total_bytes, const DeviceMap& map = {},
                                           std::string_view receiver = {},
                                           std::shared_ptr<DeviceTransfer>* staged = nullptr,
                                           const std::shared_ptr<CudaIpcLink>& ipc = nullptr,
                                           std::shared_ptr<CudaIpcLoans>* lent = nullptr);

// Decodes a tensor table and allocates an empty tensor for each entry, checking every size against the header and
// the limits first. The caller reads each tensor's bytes into `data_ptr()`. `devices`, if given, receives each
// tensor's delivery device (Message::devices; left empty when all stay on the CPU). `ipc`, if given (the connection
// agreed to CUDA IPC), receives the entries of tensors lent by CUDA IPC (Message::ipc; left null when none); without
// it such an entry is a ProtocolError.
std::vector<at::Tensor> decode_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                           std::uint64_t total_bytes, const WireLimits& limits,
                                           std::vector<std::int8_t>* devices = nullptr,
                                           std::shared_ptr<CudaIpcArrivals>* ipc = nullptr);

}  // namespace corpc::detail
