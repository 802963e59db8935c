// corpc/core/detail/dispatch.hpp — where and how a continuation runs: the resumption rule of
// corpc/core/executor.hpp as code (internal).
#pragma once

#include "corpc/core/executor.hpp"

namespace corpc::detail {

// The executor a continuation registered now should run on: the current one, else the default one (maybe null:
// inline on the completing thread).
inline Executor* resumption_executor() noexcept {
  Executor* e = current_executor();
  return e ? e : default_executor();
}

// Inline resumption nests on the stack; past this depth, continuations are queued instead.
inline thread_local int tls_inline_depth = 0;
inline constexpr int kMaxInlineDepth = 16;

// Runs `item` on `ex`: inline when `ex` is null or already drives this thread (bounded nesting), queued otherwise.
inline void dispatch(Executor* ex, WorkItem* item) noexcept {
  if (!ex || (ex->running_here() && tls_inline_depth < kMaxInlineDepth)) {
    ++tls_inline_depth;
    item->run(item);
    --tls_inline_depth;
  } else {
    ex->enqueue(item);
  }
}

}  // namespace corpc::detail
