/// @file
/// The RPC layer's errors, and every lower layer's (one include for all of corpc's error types).
#pragma once

#include <string>
#include <utility>

#include "corpc/core/errors.hpp"
#include "corpc/transport/errors.hpp"
#include "corpc/wire/errors.hpp"

namespace corpc {

/// The user function threw on the remote worker. Carries where and what.
class RemoteError : public RpcError {
 public:
  /// Built by the caller's runtime from the error reply; what() reads "remote error on worker 'W' in 'F': type:
  /// message".
  RemoteError(std::string worker, std::string function, std::string type, std::string message)
      : RpcError("remote error on worker '" + worker + "' in '" + function + "': " + type + ": " + message),
        worker_(std::move(worker)),
        function_(std::move(function)),
        type_(std::move(type)),
        message_(std::move(message)) {}
  const std::string& worker() const noexcept { return worker_; }      ///< name of the worker where it was thrown
  const std::string& function() const noexcept { return function_; }  ///< name of the function that threw

  const std::string& type() const noexcept { return type_; }        ///< demangled type of the remote exception
  const std::string& message() const noexcept { return message_; }  ///< its what()

 private:
  std::string worker_, function_, type_, message_;
};

/// The callee has no function registered under the requested name (often: different binaries).
class UnknownFunctionError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// Arguments sent do not match the callee's signature.
class ArgumentTypeError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// No worker has this name or rank.
class UnknownWorkerError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// The runtime is not initialised, or has shut down.
class ShutdownError : public RpcError {
 public:
  using RpcError::RpcError;
};

}  // namespace corpc
