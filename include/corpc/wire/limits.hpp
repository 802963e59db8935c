/// @file
/// How large a message a worker accepts from its peers: the bounds it announces to each of them when they connect
/// (RpcOptions::limits).
#pragma once

#include <cstdint>

namespace corpc {

/// Upper bounds for what a peer may announce; anything above is a ProtocolError and the connection is closed. Each
/// side announces its limits in its Hello, and senders refuse (with MessageTooLargeError) what the receiver would.
struct WireLimits {
  std::uint32_t max_body_bytes = 1u << 30;                   ///< 1 GiB of non-tensor payload (must stay below 4 GiB)
  std::uint32_t max_meta_bytes = 64u << 20;                  ///< tensor metadata
  std::uint32_t max_tensors = 1u << 20;                      ///< tensors per message
  std::uint64_t max_tensor_bytes = std::uint64_t{64} << 30;  ///< 64 GiB of tensor data per message
  std::uint32_t max_dims = 64;                               ///< dimensions per tensor
  /// A request's metadata, body and tensor data together: the receiver's budget for received requests
  /// (RpcOptions::receive_budget_*). Checked by senders; the receiver drops a larger request and answers it with
  /// MessageTooLargeError.
  std::uint64_t max_request_bytes = ~std::uint64_t{0};
};

}  // namespace corpc
