// Copies between host and device memory that a message waits for (src/memory/cuda_transfer.hpp starts them): the frame is
// written, or the message delivered, from a continuation once all of them have completed, so no thread waits.
// Torch- and CUDA-free: its bookkeeping is unit-tested without a GPU.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace corpc::detail {

class DeviceTransfer {
 public:
  using Continuation = std::function<void(std::exception_ptr error)>;

  // One more copy to wait for; call before `seal`.
  void add_part() {
    std::lock_guard lock(mutex_);
    ++pending_;
  }
  // A copy finished (from a CUDA host callback: never calls CUDA, runs the continuation if it was the last).
  void part_done(std::exception_ptr error = nullptr) noexcept { finish_one(std::move(error)); }
  // Starting a part failed (nothing to wait for from it): `error` becomes the outcome.
  void fail(std::exception_ptr error) noexcept {
    std::lock_guard lock(mutex_);
    if (!error_) error_ = std::move(error);
  }
  // Every part is added: the continuation may run once they have finished.
  void seal() noexcept { finish_one(nullptr); }
  // Runs `fn(error)` once every part has finished (here and now if they have): error is the first failure, if any.
  void then(Continuation fn) {
    std::unique_lock lock(mutex_);
    if (pending_ == 0) {
      auto error = error_;
      lock.unlock();
      return fn(error);
    }
    continuation_ = std::move(fn);
  }
  bool done() const {
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }

 private:
  void finish_one(std::exception_ptr error) noexcept {
    Continuation fn;
    std::exception_ptr first;
    {
      std::lock_guard lock(mutex_);
      if (error && !error_) error_ = std::move(error);
      if (--pending_ != 0 || !continuation_) return;
      fn = std::move(continuation_);
      first = error_;
    }
    fn(first);
  }

  mutable std::mutex mutex_;
  int pending_ = 1;  // the builder's own part, until seal()
  std::exception_ptr error_;
  Continuation continuation_;
};

}  // namespace corpc::detail
