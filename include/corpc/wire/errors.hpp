/// @file
/// The wire layer's errors: a frame that breaks the protocol, a message over the receiver's limits.
#pragma once

#include "corpc/core/errors.hpp"

namespace corpc {

/// A frame or payload broke the wire protocol (bad magic, version, length over a limit, truncated data).
class ProtocolError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// A message is larger than the receiving worker accepts (its WireLimits, announced when connecting). Raised at the
/// sender, before anything is sent: the connection and the peer are unaffected.
class MessageTooLargeError : public RpcError {
 public:
  using RpcError::RpcError;
};

}  // namespace corpc
