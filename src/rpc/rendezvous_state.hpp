// What the rendezvous keeps until every worker knows the world (rendezvous.cpp does the talking):
//   Registrations  rank 0: who has registered so far, with the connection and device configuration each came with,
//                  until the table goes out, once.
//   WorldGate      every rank: whether the world table is known yet, and the frames that arrived before it (a peer
//                  heard from rank 0 first: its Hello and the requests behind it), parked until it is and handed back
//                  in each connection's order.
// Registrations come in on any I/O thread, so two can complete at once; each part has its own lock. Registrations'
// lock is taken before the peer table's (a registration is admitted as the rank's speaker in the same step), never
// after it.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "corpc/rpc/worker_info.hpp"

#include "rpc/hello.hpp"
#include "transport/connection.hpp"

namespace corpc::detail {

class Registrations {
 public:
  using ConnectionPtr = std::shared_ptr<Connection>;

  // Rank 0 itself, before it accepts anyone (a registration may be processed the moment it is accepted).
  void add_own(WorkerInfo self, std::string device_config, LocalAddress local) {
    std::lock_guard lock(mutex_);
    entries_[self.rank] = {std::move(self), nullptr, std::move(device_config), std::move(local)};
  }

  struct Outcome {
    std::optional<std::string> rank_taken;    // another worker registered this rank: why it is turned away
    std::optional<std::string> not_admitted;  // what admit() said
    // Set when the registration names a worker that another rank registered already: the job cannot start, and
    // these are the other registrants' connections, to be told so.
    std::optional<std::string> duplicate_name;
    std::vector<ConnectionPtr> others;
  };
  // Registers `info` from `conn` unless its rank or name is taken. `admit()` runs under the lock for a registration
  // that passes those checks: it returns why the connection may not speak for the rank (nullopt: it may, and it has
  // answered), and only an admitted registration is recorded.
  template <class Admit>
  Outcome add(const WorkerInfo& info, const ConnectionPtr& conn, std::string device_config, LocalAddress local,
              Admit&& admit) {
    std::lock_guard lock(mutex_);
    if (auto same = entries_.find(info.rank); same != entries_.end())
      return {
          "rank " + std::to_string(info.rank) + " already registered by '" + same->second.info.name + "'", {}, {}, {}};
    for (const auto& [rank, other] : entries_) {
      if (other.info.name != info.name) continue;
      Outcome dup{std::nullopt,
                  std::nullopt,
                  "worker name '" + info.name + "' is already taken by rank " + std::to_string(rank) + " (rank " +
                      std::to_string(info.rank) + " claims it too): every worker needs its own name",
                  {}};
      for (const auto& [r, e] : entries_)
        if (e.conn) dup.others.push_back(e.conn);
      return dup;
    }
    if (auto refusal = admit()) return {std::nullopt, std::move(refusal), {}, {}};
    entries_[info.rank] = {info, conn, std::move(device_config), std::move(local)};
    return {};
  }

  // A registrant that left before the world was complete: forgotten, it may come back.
  void forget(const ConnectionPtr& conn) {
    std::lock_guard lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it)
      if (it->second.conn == conn) return void(entries_.erase(it));
  }

  // The ranks below `world_size` that have not registered, in words ("1, 3").
  std::string missing(int world_size) const {
    std::lock_guard lock(mutex_);
    std::string out;
    for (int r = 0; r < world_size; ++r)
      if (!entries_.count(r)) out += (out.empty() ? "" : ", ") + std::to_string(r);
    return out;
  }

  // The complete table, once: the first call after all `world_size` ranks registered gets it, every other call
  // nullopt (the last two registrations may complete at once).
  struct World {
    std::vector<WorkerInfo> workers;          // by rank
    std::vector<std::string> device_configs;  // by rank
    std::vector<LocalAddress> local;          // by rank
    std::vector<ConnectionPtr> registrants;   // everyone's but ours
  };
  std::optional<World> take_if_complete(int world_size) {
    std::lock_guard lock(mutex_);
    if (published_ || static_cast<int>(entries_.size()) < world_size) return std::nullopt;
    published_ = true;
    World w;
    for (const auto& [rank, e] : entries_) {
      w.workers.push_back(e.info);
      w.device_configs.push_back(e.device_config);
      w.local.push_back(e.local);
      if (e.conn) w.registrants.push_back(e.conn);
    }
    return w;
  }

 private:
  struct Entry {
    WorkerInfo info;
    ConnectionPtr conn;  // null for rank 0 itself
    std::string device_config;
    LocalAddress local;
  };
  mutable std::mutex mutex_;
  std::map<int, Entry> entries_;
  bool published_ = false;
};

// A connection's frames are acted on in the order it sent them, the table or not: a worker that heard from rank 0 first
// dials us and sends its Hello and its first requests in one write, which may all arrive before our table. The Hello
// is parked here, so the requests behind it are parked too (judged once it has been), and they stay parked after the
// table until the connection's own I/O thread takes them back: a request read there meanwhile must not overtake the
// parked Hello (it would be refused as coming before any Hello, and the dialer would lose us for good).
class WorldGate {
 public:
  using ConnectionPtr = std::shared_ptr<Connection>;

  // True for the first world table only: a second one (only a broken or hostile rank 0 sends one) changes nothing.
  bool first_table() noexcept { return !table_taken_.exchange(true); }
  // Whether the world table is known (then every table it wrote may be read without a lock).
  bool known() const noexcept { return known_.load(std::memory_order_acquire); }
  // Parks `msg` if the world is not known yet, or if frames `conn` sent before it are still parked (they go first);
  // false (and `msg` untouched) otherwise: the caller acts on it. A frame is either parked or sees the table: open()
  // decides under the same lock.
  bool park_if_unknown(const ConnectionPtr& conn, Message& msg) {
    if (known() && held_.load(std::memory_order_acquire) == 0) return false;
    std::lock_guard lock(mutex_);
    auto at = parked_.find(conn.get());
    if (known_.load(std::memory_order_relaxed) && at == parked_.end()) return false;
    if (at == parked_.end()) at = parked_.emplace(conn.get(), Held{conn, {}}).first;
    at->second.frames.push_back(std::move(msg));
    return true;
  }
  // The world is known from now on; returns the connections that have frames parked, each to take them back with
  // take() on its own I/O thread. Until then their frames keep being parked behind the earlier ones.
  std::vector<ConnectionPtr> open() {
    std::lock_guard lock(mutex_);
    // Before known_: a reader that sees the table known without the lock also sees that some frames are still held.
    held_.store(parked_.size(), std::memory_order_release);
    known_.store(true, std::memory_order_release);
    std::vector<ConnectionPtr> out;
    for (const auto& [raw, held] : parked_) out.push_back(held.conn);
    return out;
  }
  // What `conn` parked, in arrival order; from then on its frames are not parked. On the connection's I/O thread, the
  // one its frames are read on, so that none arrives between this and the delivery of what it returns.
  std::vector<Message> take(const Connection& conn) {
    std::lock_guard lock(mutex_);
    auto at = parked_.find(&conn);
    if (at == parked_.end()) return {};
    auto frames = std::move(at->second.frames);
    parked_.erase(at);
    if (known_.load(std::memory_order_relaxed)) held_.fetch_sub(1, std::memory_order_release);
    return frames;
  }

 private:
  struct Held {
    ConnectionPtr conn;
    std::vector<Message> frames;
  };
  std::atomic<bool> table_taken_{false};
  std::atomic<bool> known_{false};
  std::atomic<std::size_t> held_{0};  // once known: connections whose parked frames have not been taken back yet
  std::mutex mutex_;
  std::map<const Connection*, Held> parked_;
};

}  // namespace corpc::detail
