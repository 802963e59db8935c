// corpc/core/detail/event.hpp — the one-shot event every blocking wait in corpc sleeps on (internal).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace corpc::detail {

// How long a blocking wait spins before it sleeps: a short spin turns the wake-up of a sleeping core into a
// cache-line transfer when the value arrives soon, as a reply on a fast link does. Default 50 us; 0 disables.
// Process-wide; a program sets it through RpcOptions::spin_before_block (init_rpc calls the setter).
void set_spin_before_block(std::chrono::nanoseconds d) noexcept;
std::chrono::nanoseconds spin_before_block() noexcept;

// A one-shot event that one thread waits on: spins (detail::spin_before_block()), then sleeps on a futex. No mutex,
// no condition variable; `set` makes a system call only when the waiter is asleep. Waiting counts as blocking for the
// worker pool (BlockingRegion).
class Event {
 public:
  // Sets the event and wakes the waiter; any thread, once per reset().
  void set() noexcept;
  // Returns once the event is set (at once if it is); spins, then sleeps. Only one thread may wait.
  void wait() noexcept;
  // False if `deadline` passed first.
  bool wait_until(std::chrono::steady_clock::time_point deadline) noexcept;
  // Whether set() has been called since construction or the last reset().
  bool is_set() const noexcept { return state_.load(std::memory_order_acquire) == kSet; }
  // Makes the event reusable; only while no thread waits on it.
  void reset() noexcept { state_.store(kEmpty, std::memory_order_relaxed); }

 private:
  static constexpr std::uint32_t kEmpty = 0, kSet = 1, kSleeping = 2;
  std::atomic<std::uint32_t> state_{kEmpty};
};

}  // namespace corpc::detail
