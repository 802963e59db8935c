// The calls a connection has in flight: a slab of slots (request id = generation << 32 | slot) with an indexed
// min-heap of deadlines. Nothing is allocated per call once the slab has grown to the peak number in flight, a reply
// is matched in O(1), and a reply to an id this connection never issued is told apart from a late one.
// Private to the runtime; any thread, guarded by its own mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/rpc/outbound.hpp"

namespace corpc::detail {

using Clock = std::chrono::steady_clock;

struct PendingCall {
  CompleteFn complete = nullptr;
  void* target = nullptr;
  std::string_view function;   // for error messages: static storage (function_name<F>), or `owned_name`
  std::string owned_name;      // by-name calls
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  int dst = -1;
  bool counted = true;
  std::uint64_t id = 0;  // its request id, set by add (a timeout sends a cancel frame for it)
  void finish(Message* reply, std::exception_ptr error) noexcept { complete(target, dst, reply, std::move(error)); }
};

class PendingCalls {
 public:
  enum class Lookup { Found, Late, NeverIssued };

  // Registers a call; returns its request id, or 0 once the connection has closed (the call is then not taken).
  // `*earliest_changed` is set when its deadline is now the earliest.
  std::uint64_t add(PendingCall&& call, bool* earliest_changed) {
    std::lock_guard lock(mutex_);
    if (closed_) return 0;
    std::uint32_t idx;
    if (!free_.empty()) {
      idx = free_.back();
      free_.pop_back();
    } else {
      idx = static_cast<std::uint32_t>(slots_.size());
      slots_.emplace_back();
    }
    Slot& s = slots_[idx];
    ++s.generation;
    s.busy = true;
    s.call = std::move(call);
    s.call.id = (std::uint64_t{s.generation} << 32) | idx;
    heap_push(idx);
    *earliest_changed = heap_[0] == idx;
    return s.call.id;
  }

  // Removes call `id` into `out`.
  Lookup take(std::uint64_t id, PendingCall& out) {
    std::lock_guard lock(mutex_);
    const auto idx = static_cast<std::uint32_t>(id & 0xffffffffu);
    const auto gen = static_cast<std::uint32_t>(id >> 32);
    if (idx >= slots_.size() || gen == 0 || gen > slots_[idx].generation) return Lookup::NeverIssued;
    Slot& s = slots_[idx];
    if (!s.busy || gen != s.generation) return Lookup::Late;  // timed out or failed earlier
    out = std::move(s.call);
    release(idx);
    return Lookup::Found;
  }

  // Removes every call whose deadline is at or before `now`.
  void take_expired(Clock::time_point now, std::vector<PendingCall>& out) {
    std::lock_guard lock(mutex_);
    while (!heap_.empty() && slots_[heap_[0]].call.deadline <= now) {
      const auto idx = heap_[0];
      out.push_back(std::move(slots_[idx].call));
      release(idx);
    }
  }

  // Removes every call and refuses new ones (the connection is gone).
  void close_and_take_all(std::vector<PendingCall>& out) {
    std::lock_guard lock(mutex_);
    closed_ = true;
    while (!heap_.empty()) {
      const auto idx = heap_[0];
      out.push_back(std::move(slots_[idx].call));
      release(idx);
    }
  }

  Clock::time_point earliest() const {
    std::lock_guard lock(mutex_);
    return heap_.empty() ? Clock::time_point::max() : slots_[heap_[0]].call.deadline;
  }
  std::size_t size() const {
    std::lock_guard lock(mutex_);
    return heap_.size();
  }

 private:
  struct Slot {
    std::uint32_t generation = 0;
    std::uint32_t heap_pos = 0;
    bool busy = false;
    PendingCall call;
  };

  void release(std::uint32_t idx) {
    heap_erase(slots_[idx].heap_pos);
    slots_[idx].busy = false;
    slots_[idx].call.owned_name.clear();
    free_.push_back(idx);
  }

  bool earlier(std::uint32_t a, std::uint32_t b) const { return slots_[a].call.deadline < slots_[b].call.deadline; }
  void place(std::size_t pos, std::uint32_t idx) {
    heap_[pos] = idx;
    slots_[idx].heap_pos = static_cast<std::uint32_t>(pos);
  }
  void sift_up(std::size_t pos) {
    const auto idx = heap_[pos];
    while (pos > 0 && earlier(idx, heap_[(pos - 1) / 2])) {
      place(pos, heap_[(pos - 1) / 2]);
      pos = (pos - 1) / 2;
    }
    place(pos, idx);
  }
  void sift_down(std::size_t pos) {
    const auto idx = heap_[pos];
    for (;;) {
      std::size_t child = 2 * pos + 1;
      if (child >= heap_.size()) break;
      if (child + 1 < heap_.size() && earlier(heap_[child + 1], heap_[child])) ++child;
      if (!earlier(heap_[child], idx)) break;
      place(pos, heap_[child]);
      pos = child;
    }
    place(pos, idx);
  }
  void heap_push(std::uint32_t idx) {
    heap_.push_back(idx);
    sift_up(heap_.size() - 1);
  }
  void heap_erase(std::uint32_t pos) {
    const auto last = heap_.back();
    heap_.pop_back();
    if (pos == heap_.size()) return;
    place(pos, last);
    sift_up(pos);
    sift_down(slots_[last].heap_pos);
  }

  mutable std::mutex mutex_;
  bool closed_ = false;
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_;
  std::vector<std::uint32_t> heap_;  // slot indices, earliest deadline first
};

}  // namespace corpc::detail
