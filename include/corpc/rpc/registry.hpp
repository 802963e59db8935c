/// @file
/// The table of callable functions, keyed by a 64-bit id computed from the function's name.
///
/// Calls name functions by pointer (`rpc_async<&f>(...)`); the id is the hash of the function's own name
/// (corpc/core/type_name.hpp), computed at compile time, and the entry is added by a static initialiser the first time
/// the program mentions the call, so ranks that run the same binary need no registration. Processes built from
/// different sources register explicitly:
/// ```cpp
///   corpc::register_function<&f>("f");           // callee
///   corpc::rpc_async<int>("worker1", "f", 1, 2);  // caller, by name
/// ```
/// Lookups take no lock: the table is an immutable snapshot, replaced whole (copy on write) by a registration, which
/// may come before or after init_rpc. The table is process-wide and part of the one documented runtime state.
///
/// Where a function runs: on the worker pool by default, since a user function may compute for long or block, and on
/// an I/O thread it would hold up every message behind it. A short function that never blocks can run on the I/O
/// thread that read its request, which answers with no thread hand-off at all (the fastest call corpc makes):
/// ```cpp
///   CORPC_IO_THREAD_FUNCTION(&f);   // at global scope, after f and before any call to it (calls by pointer)
///   corpc::register_function<&f>("f", corpc::Execution::io_thread);  // or at registration
/// ```
/// Such a function may be a coroutine: it then resumes on that I/O thread, and a blocking wait inside it throws.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/rpc/errors.hpp"
#include "corpc/core/future.hpp"
#include "corpc/core/type_name.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/message.hpp"

namespace corpc {

/// Where a registered function runs on the callee (see corpc/rpc/registry.hpp).
enum class Execution : std::uint8_t {
  worker_pool,  ///< default: any function, including ones that block or compute for long
  io_thread,    ///< short and non-blocking: runs where its request was read, no hand-off
};

/// The execution of function F when called by pointer; specialise it with CORPC_IO_THREAD_FUNCTION(&f).
template <auto F>
inline constexpr Execution execution_of = Execution::worker_pool;

/// Marks function `fn` (`&f`) to run on the I/O thread that reads its requests (Execution::io_thread) when it is
/// called by pointer. Use it at global scope, after f's declaration and before any call to it; f must be short and
/// must never block (a blocking wait inside it throws UsageError).
#define CORPC_IO_THREAD_FUNCTION(fn) \
  template <>                        \
  inline constexpr ::corpc::Execution corpc::execution_of<fn> = ::corpc::Execution::io_thread

/// The wire id of a function registered as `name`.
constexpr std::uint64_t function_id(std::string_view name) { return fnv1a(name); }

/// What a handler sees of an incoming call.
struct Inbound {
  int src = -1;               ///< caller's rank
  std::string_view function;  ///< the name it is registered under
  Reader args;                ///< positioned at the arguments; reads tensors from `message`
  Message* message = nullptr;  ///< the whole request (header, body, tensors)
};

/// A registered function as the runtime dispatches it. Built by register_function and the call templates; layers
/// that need another encoding (the RRef protocol) build their own and add it to global_registry().
struct HandlerEntry {
  std::string name;      ///< the name callers use; its hash is `id`
  std::uint64_t id = 0;  ///< function_id(name), set by Registry::add
  std::uint64_t signature = 0;  ///< hash of the decayed parameter types; 0 accepts anything
  std::string signature_text;   ///< for error messages
  Execution execution = Execution::worker_pool;  ///< where the runtime runs it
  /// Plain functions: decodes the arguments, runs the function and encodes its result into `reply`. Throws on failure.
  void (*run_sync)(Inbound& in, Message& reply) = nullptr;
  /// Everything else (coroutine functions, Futures, the RRef layer's entries): the future of the encoded reply. The
  /// handler decodes what it needs before returning: `in` does not outlive the call.
  std::function<Future<Message>(Inbound&)> run_async;
};

/// The process-wide table of callable functions (global_registry()), keyed by id. Registrations may come from any
/// thread, before or after init_rpc; lookups take no lock.
class Registry {
 public:
  /// Adds or replaces the entry for `entry.name`; throws UsageError if another name has the same id.
  void add(HandlerEntry entry);
  /// Lock-free; nullptr if absent.
  const HandlerEntry* find(std::uint64_t id) const noexcept;

 private:
  struct Table {
    std::vector<std::shared_ptr<const HandlerEntry>> by_id;  // sorted by id
  };
  std::atomic<const Table*> current_{nullptr};
  std::mutex write_mutex_;
  std::vector<std::unique_ptr<const Table>> tables_;  // every snapshot ever published: readers never see one freed
};

/// The table every runtime of this process dispatches from.
Registry& global_registry();

}  // namespace corpc
