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
/// A registration may come before or after init_rpc. The table is process-wide and part of the one documented runtime
/// state.
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

#include <cstdint>
#include <string_view>

#include "corpc/core/type_name.hpp"

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

}  // namespace corpc
