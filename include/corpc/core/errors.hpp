/// @file
/// The typed errors every corpc future can carry.
///
/// Every failure surfaces as one of these on the future of the call it concerns; catch `RpcError` for all of them.
/// A stop is not a failure: work that was cancelled completes with CancelledError, which is deliberately *not* an
/// RpcError (as "stopped" is a third outcome beside value and error in libunifex/stdexec), so that `catch (RpcError&)`
/// error handling does not swallow a stop that should unwind the caller.
#pragma once

#include <stdexcept>
#include <string>

namespace corpc {

/// Base of every error raised by corpc itself.
class RpcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The user function threw on the remote worker. Carries where and what.
class RemoteError : public RpcError {
 public:
  /// Built by the caller's runtime from the error reply; what() reads "remote error on worker 'W' in 'F': type:
  /// message".
  RemoteError(std::string worker, std::string function, std::string type, std::string message)
      : RpcError("remote error on worker '" + worker + "' in '" + function + "': " + type + ": " + message),
        worker_(std::move(worker)), function_(std::move(function)), type_(std::move(type)),
        message_(std::move(message)) {}
  const std::string& worker() const noexcept { return worker_; }      ///< name of the worker where it was thrown
  const std::string& function() const noexcept { return function_; }  ///< name of the function that threw

  const std::string& type() const noexcept { return type_; }      ///< demangled type of the remote exception
  const std::string& message() const noexcept { return message_; }  ///< its what()

 private:
  std::string worker_, function_, type_, message_;
};

/// The call did not complete within its timeout. The remote function may still run to completion.
class TimeoutError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// The peer closed or died, or could not be reached.
class ConnectionError : public RpcError {
 public:
  using RpcError::RpcError;
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

/// The work was stopped on request: its future was cancelled (`Future::cancel()`, a stop token given in CallOptions,
/// `when_all` stopping the rest after a failure), or, on the callee, the caller cancelled the call or its deadline
/// passed. Not an RpcError (see corpc/core/errors.hpp). Test for it with `Future::cancelled()` or
/// `catch (const CancelledError&)`.
class CancelledError : public std::runtime_error {
 public:
  CancelledError() : std::runtime_error("cancelled") {}
  using std::runtime_error::runtime_error;
};

/// The runtime is not initialised, or has shut down.
class ShutdownError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// Misuse of an API (for example `local_value()` on a non-owner).
class UsageError : public RpcError {
 public:
  using RpcError::RpcError;
};

}  // namespace corpc
