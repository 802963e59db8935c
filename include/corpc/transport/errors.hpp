/// @file
/// The transport's error: a peer that closed, died or could not be reached.
#pragma once

#include "corpc/core/errors.hpp"

namespace corpc {

/// The peer closed or died, or could not be reached.
class ConnectionError : public RpcError {
 public:
  using RpcError::RpcError;
};

}  // namespace corpc
