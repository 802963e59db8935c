// The calls a connection has in flight: a slab of slots (request id = generation << 32 | slot) with an indexed
// min-heap of deadlines. Nothing is allocated per call once the slab has grown to the peak number in flight, a reply
// is matched in O(1), and a reply to an id this connection never issued is told apart from a late one.
// Private to the runtime; any thread, guarded by its own mutex.
//
// Flow control: at most `limit` calls are sent and unanswered at once (RpcOptions::max_calls_in_flight_per_peer). A
// call beyond it is registered (its deadline runs) and waits here with its frame, in order, until a reply or a
// timeout frees room; the runtime then sends it. A caller on a thread of its own may instead block until there is
// room (`add` with `block`), so that a loop issuing calls cannot pile up encoded messages without bound.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/rpc/detail/outbound.hpp"

#include "transport/frames.hpp"

namespace corpc::detail {

using Clock = std::chrono::steady_clock;

struct PendingCall {
  CompleteFn complete = nullptr;
  void* target = nullptr;
  std::string_view function;    // for error messages: static storage (function_name<F>), or `owned_name`
  std::string owned_name;       // by-name calls
  std::string_view sent_types;  // OutboundCall::sent_types
  Clock::time_point deadline;
  std::chrono::milliseconds timeout{0};
  int dst = -1;
  bool counted = true;
  std::uint64_t id = 0;  // its request id, set by add (a timeout sends a cancel frame for it)
  bool unsent = false;   // waiting for room under the limit: set by add, cleared when it is handed out to be sent
  void finish(Message* reply, std::exception_ptr error) noexcept { complete(target, dst, reply, std::move(error)); }
};

class PendingCalls {
 public:
  enum class Lookup { Found, Late, NeverIssued };
  static constexpr std::uint64_t kClosed = 0;  // `add`: the connection has closed; the call was not taken
  static constexpr std::uint64_t kNoRoom = 1;  // `add`: no room before the call's deadline (never a request id)

  void set_limit(std::size_t limit) {
    std::lock_guard lock(mutex_);
    limit_ = limit ? limit : 1;
  }

  // Registers a call and stamps its id into `frame`; returns the id (or kClosed / kNoRoom: the call was not taken).
  // `*earliest_changed` is set when its deadline is now the earliest. `limited`: the call counts against the limit
  // (corpc's own control calls do not). `*send_now`: the caller sends `frame`; false: it waits here, and a later
  // take/take_expired hands it back to be sent. `block`: wait (on this thread) for room instead, until the deadline.
  std::uint64_t add(PendingCall&& call, OutFrame& frame, bool limited, bool block, bool* earliest_changed,
                    bool* send_now) {
    std::unique_lock lock(mutex_);
    if (limited && block && !has_room()) {
      ++blocked_;
      const bool room = room_.wait_until(lock, call.deadline, [&] { return closed_ || has_room(); });
      --blocked_;
      if (!room) return kNoRoom;
    }
    if (closed_) return kClosed;
    std::uint32_t idx;
    if (!free_.empty()) {
      idx = free_.back();
      free_.pop_back();
    } else {
      idx = static_cast<std::uint32_t>(slots_.size());
      slots_.emplace_back();
    }
    Slot& s = slots_[idx];
    // Generation 0 is never used: an id of generation 0 would be the slot's index alone, and slots 0 and 1 would give
    // ids that read as kClosed and kNoRoom (after 2^32 calls through one slot).
    if (++s.generation == 0) s.generation = 1;
    s.busy = true;
    s.call = std::move(call);
    s.call.id = (std::uint64_t{s.generation} << 32) | idx;
    heap_push(idx);
    *earliest_changed = heap_[0] == idx;
    const std::uint64_t id = s.call.id;
    frame.head.id = id;
    *send_now = !limited || has_room();
    if (!*send_now) {
      s.call.unsent = true;
      waiting_.push_back({id, std::move(frame)});
    } else if (limited) {
      s.in_flight = true;
      ++in_flight_;
    }
    return id;
  }

  // Removes call `id` into `out`; a waiting call that may go now is appended to `ready`.
  Lookup take(std::uint64_t id, PendingCall& out, std::vector<OutFrame>& ready) {
    std::lock_guard lock(mutex_);
    const auto idx = static_cast<std::uint32_t>(id & 0xffffffffu);
    const auto gen = static_cast<std::uint32_t>(id >> 32);
    if (idx >= slots_.size() || gen == 0 || gen > slots_[idx].generation) return Lookup::NeverIssued;
    Slot& s = slots_[idx];
    if (!s.busy || gen != s.generation) return Lookup::Late;  // timed out or failed earlier
    out = std::move(s.call);
    release(idx);
    promote(ready);
    return Lookup::Found;
  }

  // Removes every call whose deadline is at or before `now`; waiting calls that may go now are appended to `ready`.
  void take_expired(Clock::time_point now, std::vector<PendingCall>& out, std::vector<OutFrame>& ready) {
    std::lock_guard lock(mutex_);
    while (!heap_.empty() && slots_[heap_[0]].call.deadline <= now) {
      const auto idx = heap_[0];
      out.push_back(std::move(slots_[idx].call));
      release(idx);
    }
    promote(ready);
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
    waiting_.clear();
    room_.notify_all();
  }

  Clock::time_point earliest() const {
    std::lock_guard lock(mutex_);
    return heap_.empty() ? Clock::time_point::max() : slots_[heap_[0]].call.deadline;
  }
  std::size_t size() const {
    std::lock_guard lock(mutex_);
    return heap_.size();
  }
  std::size_t waiting() const {
    std::lock_guard lock(mutex_);
    return waiting_.size();
  }

 private:
  struct Slot {
    std::uint32_t generation = 0;
    std::uint32_t heap_pos = 0;
    bool busy = false;
    bool in_flight = false;  // sent, and counted against the limit
    PendingCall call;
  };
  struct Waiting {
    std::uint64_t id;
    OutFrame frame;
  };

  bool has_room() const noexcept { return in_flight_ < limit_ && waiting_.empty(); }

  // Hands waiting calls that fit under the limit to the caller, to be sent; skips those that have timed out or failed.
  void promote(std::vector<OutFrame>& ready) {
    while (in_flight_ < limit_ && !waiting_.empty()) {
      Waiting w = std::move(waiting_.front());
      waiting_.pop_front();
      const auto idx = static_cast<std::uint32_t>(w.id & 0xffffffffu);
      Slot& s = slots_[idx];
      if (!s.busy || s.generation != static_cast<std::uint32_t>(w.id >> 32)) continue;
      s.call.unsent = false;
      s.in_flight = true;
      ++in_flight_;
      ready.push_back(std::move(w.frame));
    }
    if (blocked_ && has_room()) room_.notify_all();
  }

  void release(std::uint32_t idx) {
    heap_erase(slots_[idx].heap_pos);
    if (slots_[idx].in_flight) --in_flight_;
    slots_[idx].in_flight = false;
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
  std::size_t limit_ = ~std::size_t{0};
  std::size_t in_flight_ = 0;
  std::size_t blocked_ = 0;  // threads waiting in `add` for room
  std::condition_variable room_;
  std::deque<Waiting> waiting_;  // registered, not sent: in order
  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_;
  std::vector<std::uint32_t> heap_;  // slot indices, earliest deadline first
};

}  // namespace corpc::detail
