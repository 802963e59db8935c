/// @file
/// The root of corpc's errors, and the core's own.
///
/// Everything corpc throws is a `corpc::Error`. Every failure is an `RpcError` and surfaces on the future of the
/// call it concerns; catch `RpcError` for all of them. A stop is not a failure: work that was cancelled completes
/// with CancelledError, which is deliberately *not* an RpcError (as "stopped" is a third outcome beside value and
/// error in libunifex/stdexec), so that `catch (RpcError&)` error handling does not swallow a stop that should unwind
/// the caller. Each layer defines the failures it raises first: ProtocolError and MessageTooLargeError in
/// corpc/wire/errors.hpp, ConnectionError in corpc/transport/errors.hpp, the rest in corpc/rpc/errors.hpp.
#pragma once

#include <stdexcept>
#include <string>

namespace corpc {

/// The root of every exception corpc throws.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A failure: the base of every error but a stop (CancelledError).
class RpcError : public Error {
 public:
  using Error::Error;
};

/// The call did not complete within its timeout. The remote function may still run to completion.
class TimeoutError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// The work was stopped on request: its future was cancelled (`Future::cancel()`, a stop token given in CallOptions,
/// `when_all` stopping the rest after a failure), or, on the callee, the caller cancelled the call or its deadline
/// passed. Not an RpcError (see corpc/core/errors.hpp). Test for it with `Future::cancelled()` or
/// `catch (const CancelledError&)`.
class CancelledError : public Error {
 public:
  CancelledError() : Error("cancelled") {}
  using Error::Error;
};

/// Misuse of an API (for example `local_value()` on a non-owner).
class UsageError : public RpcError {
 public:
  using RpcError::RpcError;
};

}  // namespace corpc
