// corpc/rpc/detail/registry.hpp — the table of callable functions as the runtime dispatches from it (internal).
// Lookups take no lock: the table is an immutable snapshot, replaced whole (copy on write) by a registration.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/core/future.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/registry.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/detail/message.hpp"

namespace corpc::detail {

// What a handler sees of an incoming call.
struct Inbound {
  int src = -1;                // caller's rank
  std::string_view function;   // the name it is registered under
  Reader args;                 // positioned at the arguments; reads tensors from `message`
  Message* message = nullptr;  // the whole request (header, body, tensors)
};

// A registered function as the runtime dispatches it. Built by register_function and the call templates; layers
// that need another encoding (the RRef protocol) build their own and add it to global_registry().
struct HandlerEntry {
  std::string name;                              // the name callers use; its hash is `id`
  std::uint64_t id = 0;                          // function_id(name), set by Registry::add
  std::uint64_t signature = 0;                   // hash of the decayed parameter types; 0 accepts anything
  std::string signature_text;                    // for error messages
  Execution execution = Execution::worker_pool;  // where the runtime runs it
  // Plain functions: decodes the arguments, runs the function and encodes its result into `reply`. Throws on failure.
  void (*run_sync)(Inbound& in, Message& reply) = nullptr;
  // Everything else (coroutine functions, Futures, the RRef layer's entries): the future of the encoded reply. The
  // handler decodes what it needs before returning: `in` does not outlive the call.
  std::function<Future<Message>(Inbound&)> run_async;
};

// The process-wide table of callable functions (global_registry()), keyed by id. Registrations may come from any
// thread, before or after init_rpc; lookups take no lock.
class Registry {
 public:
  // Adds or replaces the entry for `entry.name`; throws UsageError if another name has the same id.
  void add(HandlerEntry entry);
  // Lock-free; nullptr if absent.
  const HandlerEntry* find(std::uint64_t id) const noexcept;

 private:
  struct Table {
    std::vector<std::shared_ptr<const HandlerEntry>> by_id;  // sorted by id
  };
  std::atomic<const Table*> current_{nullptr};
  std::mutex write_mutex_;
  std::vector<std::unique_ptr<const Table>> tables_;  // every snapshot ever published: readers never see one freed
};

// The table every runtime of this process dispatches from.
Registry& global_registry();

}  // namespace corpc::detail
