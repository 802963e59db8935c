/// @file
/// Per-coroutine ambient state that follows a coroutine across threads.
///
/// A plain thread_local is lost when a coroutine resumes on another thread, and leaks into whatever the thread runs
/// next. corpc's awaitables save the context when a coroutine suspends and restore it around its resumption, wherever
/// that is; starting a coroutine (`spawn`, `sync_wait`) and running posted work restore the starter's own context
/// afterwards. So an RPC issued after a `co_await` inside a distributed-autograd context still belongs to that context,
/// and the context never outlives the coroutine that opened it.
///
/// The core knows nothing of what the slots mean: layers allocate a slot once (`CallContext::new_slot()`) and keep
/// their own value in it (distributed autograd keeps its context id).
///
/// Two fields are the core's own, because awaiting depends on them: the stop token of the work the coroutine belongs
/// to (the RPC it is handling, a TaskScope), and that work's deadline. Users read them through corpc::this_call
/// (corpc/core/this_call.hpp). An empty token (the common case) costs a pointer copy per suspension.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <stop_token>

namespace corpc {

/// The ambient state of one coroutine (see corpc/core/call_context.hpp): a few integer slots that upper layers own, and
/// the stop token and deadline of the work the coroutine belongs to. A plain value; copying it is cheap.
struct CallContext {
  static constexpr int kSlots = 4;            ///< Slots available to layers in one process (new_slot() hands them out).
  static constexpr std::int64_t kUnset = -1;  ///< The value of a slot nobody has set.
  std::array<std::int64_t, kSlots> slots{kUnset, kUnset, kUnset, kUnset};  ///< One value per allocated slot.
  std::stop_token stop;  ///< asked to stop: awaits of corpc futures complete as cancelled
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();  ///< max: none

  /// A process-wide slot index for one layer's value; throws UsageError when all are taken.
  static int new_slot();
  /// The value in `slot` (an index from new_slot()), kUnset if none.
  std::int64_t get(int slot) const noexcept { return slots[slot]; }
  /// Stores `v` in `slot` of this context (not of the current one unless this is current_call_context()).
  void set(int slot, std::int64_t v) noexcept { slots[slot] = v; }
  /// Equal when every slot, the stop token and the deadline are.
  friend bool operator==(const CallContext&, const CallContext&) = default;
};

/// The calling thread's (that is, the running coroutine's) context.
CallContext& current_call_context() noexcept;

/// Sets the context for the guard's lifetime, then restores the previous one.
class CallContextScope {
 public:
  /// Makes `c` the calling thread's context until the guard is destroyed.
  explicit CallContextScope(const CallContext& c) noexcept : previous_(current_call_context()) {
    current_call_context() = c;
  }
  ~CallContextScope() { current_call_context() = previous_; }
  CallContextScope(const CallContextScope&) = delete;
  CallContextScope& operator=(const CallContextScope&) = delete;

 private:
  CallContext previous_;
};

}  // namespace corpc
