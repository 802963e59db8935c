// corpc/core/detail/manual_executor.hpp — the executor that sync_wait's thread drains by hand (internal).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "corpc/core/executor.hpp"

namespace corpc::detail {

// An executor drained by hand, by the one thread that owns it (sync_wait's). Enqueueing is lock-free.
class ManualExecutor final : public Executor {
 public:
  void enqueue(WorkItem* item) noexcept override;
  bool running_here() const noexcept override { return owner_ == std::this_thread::get_id(); }
  // Runs queued work until `done` is set; sleeps (after a short spin) while there is none.
  void run_until(const std::atomic<bool>& done);
  // Wakes run_until so that it re-checks `done`.
  void notify() noexcept;

 private:
  std::atomic<WorkItem*> inbox_{nullptr};  // LIFO stack of pushed items; reversed when drained
  std::atomic<std::uint32_t> wake_{0};     // futex word: bumped on every push and notify
  std::atomic<bool> sleeping_{false};
  std::thread::id owner_;
};

}  // namespace corpc::detail
