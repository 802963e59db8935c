// The process-wide budget for what peers' requests may occupy here: bytes (each request's meta, body and tensor data,
// as its header announces them) and a count (requests queued for the worker pool or running). Connections reserve
// from it before they allocate a request and pause reading while it is spent, so that TCP slows the senders down;
// a reservation is given back when its request has been answered. Private to the transport; any thread.
//
// Replies to our own calls are not charged: they were asked for, they are bounded by the calls we have in flight
// (RpcOptions::max_calls_in_flight_per_peer), and pausing them could stall the very handlers that hold the budget.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

namespace corpc::detail {

class ReceiveBudget {
 public:
  ReceiveBudget(std::uint64_t bytes, std::uint64_t requests) : bytes_limit_(bytes), requests_limit_(requests) {}

  std::uint64_t bytes_limit() const noexcept { return bytes_limit_; }

  // Takes `bytes` and one request, or nothing (false) if either would go over.
  bool try_take(std::uint64_t bytes) noexcept {
    if (!take(bytes_used_, bytes, bytes_limit_)) return false;
    if (!take(requests_used_, 1, requests_limit_)) {
      bytes_used_.fetch_sub(bytes);
      return false;
    }
    return true;
  }

  void give_back(std::uint64_t bytes) noexcept {
    bytes_used_.fetch_sub(bytes);
    requests_used_.fetch_sub(1);
    if (waiting_.load() > 0) wake_all();
  }

  // Calls `wake` (once, from whichever thread gives something back next). The caller re-checks after registering:
  // a give_back that ran before the registration is then seen by that check (all operations are sequentially
  // consistent), one that runs after it calls `wake`.
  void on_next_give_back(std::function<void()> wake) {
    std::lock_guard lock(mutex_);
    waiters_.push_back(std::move(wake));
    waiting_.fetch_add(1);
  }

  std::uint64_t bytes_used() const noexcept { return bytes_used_.load(); }

 private:
  static bool take(std::atomic<std::uint64_t>& used, std::uint64_t n, std::uint64_t limit) noexcept {
    std::uint64_t u = used.load();
    do {
      if (n > limit || u > limit - n) return false;
    } while (!used.compare_exchange_weak(u, u + n));
    return true;
  }

  void wake_all() {
    std::vector<std::function<void()>> wake;
    {
      std::lock_guard lock(mutex_);
      wake.swap(waiters_);
      waiting_.store(0);
    }
    for (auto& w : wake) w();
  }

  const std::uint64_t bytes_limit_, requests_limit_;
  std::atomic<std::uint64_t> bytes_used_{0}, requests_used_{0};
  std::atomic<int> waiting_{0};
  std::mutex mutex_;
  std::vector<std::function<void()>> waiters_;
};

}  // namespace corpc::detail
