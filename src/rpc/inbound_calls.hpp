// The requests a connection's peer has running here that can still be stopped, so that a cancel frame (or the loss
// of the connection) reaches the handler's stop token. Private to the runtime; any thread, guarded by its own mutex.
//
// Indexed by the caller's slot (the low 32 bits of its request id, see pending_calls.hpp): slots are dense and
// bounded by the caller's calls in flight, so lookups are O(1) and the table stops growing at the peak. A caller
// that sends ids with absurd slots gets calls that cannot be cancelled, not a huge table.
#pragma once

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <stop_token>
#include <utility>
#include <vector>

namespace corpc::detail {

class InboundCalls {
 public:
  static constexpr std::uint32_t kMaxSlots = 1u << 20;

  // Registers request `id` (replacing an older request in its slot, whose caller has moved on); returns the token
  // its handler runs with.
  std::stop_token add(std::uint64_t id) {
    const auto idx = static_cast<std::uint32_t>(id & 0xffffffffu);
    if (idx >= kMaxSlots) return {};
    std::stop_source source;
    std::stop_token token = source.get_token();
    std::lock_guard lock(mutex_);
    if (idx >= entries_.size()) entries_.resize(std::max<std::size_t>(idx + 1, entries_.size() * 2));
    entries_[idx].id = id;
    entries_[idx].source = std::move(source);
    if (closed_) entries_[idx].source.request_stop();
    return token;
  }
  // The handler of `id` has finished.
  void remove(std::uint64_t id) noexcept {
    std::stop_source drop{std::nostopstate};  // released outside the lock
    std::lock_guard lock(mutex_);
    if (Entry* e = find(id)) drop = std::exchange(e->source, std::stop_source(std::nostopstate));
  }
  // The caller cancelled `id` (or its deadline passed there). Callbacks run here, outside the lock.
  void cancel(std::uint64_t id) noexcept {
    std::stop_source source{std::nostopstate};
    {
      std::lock_guard lock(mutex_);
      if (Entry* e = find(id)) source = e->source;
    }
    source.request_stop();
  }
  // The connection is gone: nobody waits for these any more; later registrations start stopped.
  void cancel_all() noexcept {
    std::vector<std::stop_source> sources;
    {
      std::lock_guard lock(mutex_);
      closed_ = true;
      for (auto& e : entries_)
        if (e.source.stop_possible()) sources.push_back(e.source);
    }
    for (auto& s : sources) s.request_stop();
  }

 private:
  struct Entry {
    std::uint64_t id = 0;
    std::stop_source source{std::nostopstate};
  };
  Entry* find(std::uint64_t id) noexcept {
    const auto idx = static_cast<std::uint32_t>(id & 0xffffffffu);
    if (idx >= entries_.size() || entries_[idx].id != id || !entries_[idx].source.stop_possible()) return nullptr;
    return &entries_[idx];
  }

  std::mutex mutex_;
  bool closed_ = false;
  std::vector<Entry> entries_;
};

}  // namespace corpc::detail
