// corpc/rpc/detail/outbound.hpp — the one entry point through which every call leaves this process (internal).
//
// The call templates (rpc_async, RRef proxies, the RRef protocol) encode their arguments into an OutboundCall and hand
// it to start_call, which frames it, checks it against the receiver's limits, registers it on the connection to its
// destination (with its deadline), counts it for graceful shutdown, and sends it — in that order, so that a failure at
// any step fails only this call and leaves every count balanced. The call's timeout is cut to what is left of the
// deadline of the call being handled (CallContext), so deadlines shrink along a chain of calls; when it passes, or the
// caller's future is cancelled, the callee is sent a cancel frame for it.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string_view>

#include "corpc/core/future.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/wire/detail/message.hpp"

namespace corpc {
class Runtime;
}

namespace corpc::detail {

// Completes a call: decodes `reply` (from rank `src`) into the caller's future, or fails it with `error`. Runs exactly
// once, on the thread that learns the outcome (an I/O thread for replies); must not block.
using CompleteFn = void (*)(void* target, int src, Message* reply, std::exception_ptr error) noexcept;

struct OutboundCall {
  int dst = -1;
  std::string_view function;        // its name, for errors
  bool function_is_static = false;  // `function` points to static storage (function_name<F>): no copy is kept
  std::uint64_t function_id = 0;
  std::uint64_t signature = 0;
  std::string_view sent_types;  // the argument types as encoded (static storage), added to an argument-type refusal
  std::optional<std::chrono::milliseconds> timeout;  // unset: RpcOptions::rpc_timeout
  bool control = false;                              // corpc's own shutdown protocol: not counted as work in flight
  bool send_now = false;  // the caller blocks on the reply next (rpc_sync): the request is never held to coalesce
  Message message;        // body and tensors; the runtime fills in the header
  CompleteFn complete = nullptr;
  void* target = nullptr;
  CancelSlot* cancel = nullptr;  // the caller's future: armed so that cancelling it cancels the call on its callee
};

// Sends `call` through `runtime`. Never throws: every failure reaches `complete`.
void start_call(Runtime& runtime, OutboundCall&& call) noexcept;

}  // namespace corpc::detail
