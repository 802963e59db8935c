// corpc/core/call_context.hpp — per-coroutine ambient state that follows a coroutine across threads.
//
// A plain thread_local is lost when a coroutine resumes on another thread. corpc's awaitables (Future, Task) save the
// context when a coroutine suspends and restore it when it resumes, wherever that is; jobs posted to executors and
// `then` callbacks restore the context of the code that registered them. So, e.g., an RPC issued after a `co_await`
// inside a distributed-autograd context still belongs to that context.
#pragma once

#include <cstdint>

namespace corpc {

struct CallContext {
  std::int64_t autograd_context_id = -1;  // -1: no distributed autograd context
};

// The calling thread's (that is, the running coroutine's) context.
CallContext& current_call_context() noexcept;

// Sets the context for the guard's lifetime, then restores the previous one.
class CallContextScope {
 public:
  explicit CallContextScope(CallContext c) noexcept : previous_(current_call_context()) { current_call_context() = c; }
  ~CallContextScope() { current_call_context() = previous_; }
  CallContextScope(const CallContextScope&) = delete;
  CallContextScope& operator=(const CallContextScope&) = delete;

 private:
  CallContext previous_;
};

}  // namespace corpc
