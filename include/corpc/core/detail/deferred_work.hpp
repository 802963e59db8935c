// corpc/core/detail/deferred_work.hpp — work a thread puts off until it would block or finish its job (internal).
#pragma once

namespace corpc::detail {

// The sends a thread staged, so that calls issued back to back leave in one system call (the transport registers
// the one function). Armed per thread by defer_work(); run by check_may_block (before any blocking wait) and after
// each worker-pool job. Whoever defers must also have arranged a fallback (the transport posts a flush to the
// connection's I/O thread), for a thread that does neither.
using DeferredWork = void (*)() noexcept;
void set_deferred_work(DeferredWork fn) noexcept;
inline thread_local bool tls_work_deferred = false;
void run_deferred_work() noexcept;
inline void defer_work() noexcept { tls_work_deferred = true; }

}  // namespace corpc::detail
