// corpc/core/detail/blocking.hpp — how a thread tells corpc that it must not block, or that it is about to
// (internal). The public rule and its checks (blocking_forbidden, check_may_block) are in corpc/core/executor.hpp.
#pragma once

namespace corpc {
class ThreadPool;
}  // namespace corpc

namespace corpc::detail {

// Marks the calling thread as one that must never block (the runtime's I/O threads) for the guard's lifetime:
// corpc::check_may_block throws there.
class NonBlockingThreadScope {
 public:
  NonBlockingThreadScope() noexcept;
  ~NonBlockingThreadScope();
  NonBlockingThreadScope(const NonBlockingThreadScope&) = delete;
  NonBlockingThreadScope& operator=(const NonBlockingThreadScope&) = delete;

 private:
  bool previous_;
};

// Tells the ThreadPool driving this thread (if any) that the thread is about to block, for the guard's lifetime, so
// that the pool can keep its number of runnable threads. Every blocking wait in corpc holds one (Event's waits,
// sync_wait's executor).
class BlockingRegion {
 public:
  BlockingRegion() noexcept;
  ~BlockingRegion();
  BlockingRegion(const BlockingRegion&) = delete;
  BlockingRegion& operator=(const BlockingRegion&) = delete;

 private:
  ThreadPool* pool_;
};

}  // namespace corpc::detail
