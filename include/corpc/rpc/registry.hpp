// corpc/rpc/registry.hpp — the table of callable functions, keyed by name.
//
// Calls name functions by pointer (`rpc_async<&f>(...)`); the key is the function's own name (corpc/core/type_name.hpp)
// and the entry is added by a static initialiser the first time the program mentions the call, so ranks that run the
// same binary need no registration. Processes built from different sources register explicitly:
//   corpc::register_function<&f>("f");     // callee
//   corpc::rpc_async<int>("worker1", "f", 1, 2);  // caller, by name
// The table is process-wide (it is filled before main runs) and is part of the one documented runtime state.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include "corpc/core/future.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/message.hpp"

namespace corpc {

// What a handler sees of an incoming call.
struct Inbound {
  int src = -1;                 // caller's rank
  std::string_view function;    // key it was called by
  Reader args;                  // positioned at the arguments
  Message* message = nullptr;   // owns the body and tensors `args` reads from
};

// A handler decodes its arguments, runs the function and returns the encoded reply (see make_reply()).
using Handler = std::function<Future<Message>(Inbound&)>;

struct HandlerEntry {
  Handler handler;
  std::uint64_t signature = 0;  // hash of the decayed parameter types; 0 accepts anything
  std::string signature_text;   // for error messages
};

class Registry {
 public:
  void add(std::string name, HandlerEntry entry) {
    std::lock_guard lock(mutex_);
    table_.insert_or_assign(std::move(name), std::make_shared<HandlerEntry>(std::move(entry)));
  }
  std::shared_ptr<const HandlerEntry> find(std::string_view name) const {
    std::lock_guard lock(mutex_);
    auto it = table_.find(std::string(name));
    return it == table_.end() ? nullptr : it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<HandlerEntry>> table_;
};

Registry& global_registry();

// Bytes every reply body starts with, filled in by the runtime (distributed-autograd ids).
inline constexpr std::size_t kReplyEnvelopeBytes = 16;

inline Message make_reply() {
  Message m;
  m.kind = FrameKind::Response;
  m.body.assign(kReplyEnvelopeBytes, '\0');
  return m;
}

}  // namespace corpc
