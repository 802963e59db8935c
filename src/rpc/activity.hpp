// What this worker has in flight, for graceful shutdown and the runtime's counters: user calls sent and not yet
// completed, handlers running, and per peer the user requests sent to it and handled from it (shutdown balances the
// two across the job). Whoever brings a count to zero wakes a shutdown waiting for quiet; nobody polls.
// Any thread; the counters are atomics, the wait a condition variable that only a waiting shutdown pays for.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace corpc::detail {

class Activity {
 public:
  explicit Activity(int world_size)
      : world_size_(world_size),
        sent_to_(std::make_unique<std::atomic<std::uint64_t>[]>(world_size)),
        handled_from_(std::make_unique<std::atomic<std::uint64_t>[]>(world_size)) {}

  // A user call was registered (it counts until call_done).
  void call_started() noexcept { calls_in_flight_.fetch_add(1, std::memory_order_relaxed); }
  void call_done() noexcept {
    if (calls_in_flight_.fetch_sub(1) == 1) wake();
  }
  // A user request left for `dst`.
  void request_sent(int dst) noexcept {
    requests_sent_.fetch_add(1, std::memory_order_relaxed);
    sent_to_[dst].fetch_add(1, std::memory_order_relaxed);
  }
  // A user request's handler started (it counts until handler_done).
  void handler_started() noexcept { handlers_running_.fetch_add(1, std::memory_order_relaxed); }
  void handler_done() noexcept {
    if (handlers_running_.fetch_sub(1) == 1) wake();
  }
  // A user request from `src` was handled (replied to or refused). `src` may be unknown (-1).
  void request_handled(int src) noexcept {
    requests_handled_.fetch_add(1, std::memory_order_relaxed);
    if (src >= 0 && src < world_size_) handled_from_[src].fetch_add(1, std::memory_order_relaxed);
  }

  // `rank` has a new incarnation (it rejoined): what was sent to and handled from its predecessor no longer counts.
  // Called before the new incarnation's first request is read and before our first request to it is sent.
  void forget_peer(int rank) noexcept {
    if (rank < 0 || rank >= world_size_) return;
    sent_to_[rank].store(0);
    handled_from_[rank].store(0);
  }

  std::vector<std::uint64_t> sent_counts() const { return snapshot(sent_to_); }
  std::vector<std::uint64_t> handled_counts() const { return snapshot(handled_from_); }
  std::uint64_t requests_sent() const noexcept { return requests_sent_.load(); }
  std::uint64_t requests_handled() const noexcept { return requests_handled_.load(); }
  std::uint64_t calls_in_flight() const noexcept { return calls_in_flight_.load(); }
  std::uint64_t handlers_running() const noexcept { return handlers_running_.load(); }

  // No call in flight, no handler running, and `also_idle()` (work this class does not count: the background scope).
  bool idle(const std::function<bool()>& also_idle) const {
    return calls_in_flight_.load() == 0 && handlers_running_.load() == 0 && also_idle();
  }
  // Waits until idle(also_idle) or `deadline`; true if idle. `also_idle`'s owner calls wake() when it may have become
  // true; `before_each_check` lets it arm that (it runs before every look at the counters).
  bool wait_idle(std::chrono::steady_clock::time_point deadline, const std::function<bool()>& also_idle,
                 const std::function<void()>& before_each_check) {
    waited_.store(true);
    bool quiet = false;
    for (;;) {
      before_each_check();
      std::unique_lock lock(mutex_);
      if ((quiet = idle(also_idle))) break;
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
        quiet = idle(also_idle);
        break;
      }
    }
    waited_.store(false);
    return quiet;
  }
  // Wakes a waiting wait_idle, if any (seq_cst with the counters: no lost wake-up).
  void wake() noexcept {
    if (!waited_.load()) return;
    std::lock_guard lock(mutex_);
    cv_.notify_all();
  }

 private:
  std::vector<std::uint64_t> snapshot(const std::unique_ptr<std::atomic<std::uint64_t>[]>& c) const {
    std::vector<std::uint64_t> v(world_size_);
    for (int i = 0; i < world_size_; ++i) v[i] = c[i].load();
    return v;
  }

  const int world_size_;
  std::atomic<std::uint64_t> requests_sent_{0}, requests_handled_{0}, calls_in_flight_{0}, handlers_running_{0};
  std::unique_ptr<std::atomic<std::uint64_t>[]> sent_to_, handled_from_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<bool> waited_{false};
};

}  // namespace corpc::detail
