// corpc/core/detail/cancel_slot.hpp — how a future asks its producer to stop (internal).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace corpc::detail {

// What a producer arms to be told to stop. The hook must be short and must not block; `keep` holds what it needs
// alive for as long as the state lives (it must not reference the state itself). `p`, `a` and `b` are free for the
// hook's own use (an RPC's connection, destination and request id).
struct CancelHook {
  void (*fn)(const CancelHook&) noexcept = nullptr;
  std::shared_ptr<void> keep;
  void* p = nullptr;
  std::uint64_t a = 0, b = 0;
};

// The producer arms a hook once; the first cancel request runs it (at once, or when the hook is armed if the request
// came first). FutureState derives from it, and waiters that only ask to stop hold it as a CancelSlot.
class CancelSlot {
 public:
  void arm_cancel(CancelHook h) noexcept {
    hook_ = std::move(h);
    std::uint8_t s = kIdle;
    if (!cancel_state_.compare_exchange_strong(s, kArmed, std::memory_order_acq_rel)) hook_.fn(hook_);  // requested
  }
  // True for the first request only.
  bool request_cancel() noexcept {
    const std::uint8_t old = cancel_state_.exchange(kRequested, std::memory_order_acq_rel);
    if (old == kArmed) hook_.fn(hook_);
    return old != kRequested;
  }

 private:
  static constexpr std::uint8_t kIdle = 0, kArmed = 1, kRequested = 2;
  std::atomic<std::uint8_t> cancel_state_{kIdle};
  CancelHook hook_;
};

}  // namespace corpc::detail
