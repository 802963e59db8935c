// Who this worker talks to: the connection our requests to each rank go on, the connections peers dialed to us, which
// connection speaks for each rank, and which ranks are gone and why. One lock guards it all, held only for table work
// (a dial is started under it, never awaited), so any thread may use it: callers, I/O threads, shutdown.
//
// A rank has two connections: ours (dialed by us, carrying our requests and their replies) and at most one accepted
// one that speaks for it (its Hello claimed the rank and was admitted: only its requests count for the rank, and only
// its loss, or the loss of ours, makes the rank dead). A second claimant is refused while the holder is alive.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "corpc/rpc/errors.hpp"

#include "rpc/hello.hpp"
#include "transport/connection.hpp"

namespace corpc::detail {

class PeerTable {
 public:
  using ConnectionPtr = std::shared_ptr<Connection>;

  explicit PeerTable(int world_size) : outgoing_(world_size), dead_(world_size), farewells_(world_size) {}

  // Where a rank listens, when it is not where the world table said: a rank that rejoined (RpcOptions::rejoin).
  struct Address {
    std::string host;
    std::uint16_t port = 0;
    LocalAddress local;  // where it takes connections from its own host
  };

  // Our connection to `rank`, made by `dial(moved)` (under the lock, so there is one) if there is none yet; `moved`
  // is the rank's address if it rejoined since the world table, else null. Throws ShutdownError once closing,
  // ConnectionError (naming it `name`) if the rank is gone.
  template <class Dial>
  ConnectionPtr outgoing_to(int rank, const std::string& name, Dial&& dial) {
    std::lock_guard lock(mutex_);
    if (closing_) throw ShutdownError("corpc runtime is shutting down");
    if (!dead_[rank].empty())
      throw ConnectionError("worker '" + name + "' (rank " + std::to_string(rank) + ") is gone: " + dead_[rank]);
    auto& c = outgoing_[rank];
    if (!c) {
      auto moved = moved_.find(rank);
      c = dial(moved == moved_.end() ? nullptr : &moved->second);
    }
    return c;
  }
  // Every rank's address as the table says it now: `table`'s, with the moves of ranks that rejoined.
  template <class Worker>
  std::vector<Worker> current_addresses(std::vector<Worker> table) const {
    std::lock_guard lock(mutex_);
    for (const auto& [rank, a] : moved_) {
      table[rank].host = a.host;
      table[rank].port = a.port;
    }
    return table;
  }
  // The same for where each rank takes connections from its own host.
  std::vector<LocalAddress> current_local_addresses(std::vector<LocalAddress> table) const {
    std::lock_guard lock(mutex_);
    for (const auto& [rank, a] : moved_) table[rank] = a.local;
    return table;
  }

  // A new incarnation of `rank` (it rejoined, RpcOptions::rejoin) claims it on `conn` and now listens at `at`. Admitted
  // if no live connection speaks for the rank: the rank is alive again, our old connection to it (if any, to be
  // closed) is forgotten, and `admitted` runs under the lock as with claim(). Returns (why not, or nullopt; our old
  // connection to close, or null).
  template <class Admitted>
  std::pair<std::optional<std::string>, ConnectionPtr> revive(int rank, const ConnectionPtr& conn, Address at,
                                                              Admitted&& admitted) {
    std::lock_guard lock(mutex_);
    if (closing_) return {"shutting down", nullptr};
    if (auto held = holders_.find(rank); held != holders_.end())
      return {"rank " + std::to_string(rank) + " is still connected here (from " + held->second->remote_address +
                  "); a replacement is taken once its predecessor's connection has closed",
              nullptr};
    holders_[rank] = conn;
    conn->peer_rank = rank;
    dead_[rank].clear();
    farewells_[rank].clear();
    moved_[rank] = std::move(at);
    ConnectionPtr old = std::exchange(outgoing_[rank], nullptr);
    admitted();
    return {std::nullopt, std::move(old)};
  }
  // Rank 0 says that a new incarnation of `rank` took it over and listens at `at`: the rank is alive again here, and
  // what we held of its predecessor is forgotten. Returns the predecessor's connections (ours, and the one that spoke
  // for it), to be closed: they no longer count for the rank.
  std::vector<ConnectionPtr> replaced(int rank, Address at) {
    std::lock_guard lock(mutex_);
    std::vector<ConnectionPtr> old;
    if (closing_ || rank < 0 || rank >= size()) return old;
    dead_[rank].clear();
    farewells_[rank].clear();
    moved_[rank] = std::move(at);
    if (outgoing_[rank]) old.push_back(std::exchange(outgoing_[rank], nullptr));
    if (auto held = holders_.find(rank); held != holders_.end()) {
      old.push_back(held->second);
      holders_.erase(held);
    }
    return old;
  }
  // The connection that speaks for `rank` (null if none): on rank 0, the one the rank registered through.
  ConnectionPtr speaker(int rank) const {
    std::lock_guard lock(mutex_);
    auto held = holders_.find(rank);
    return held == holders_.end() ? nullptr : held->second;
  }
  // Installs our connection to `rank` (the rendezvous's dial to rank 0).
  void set_outgoing(int rank, ConnectionPtr conn) {
    std::lock_guard lock(mutex_);
    outgoing_[rank] = std::move(conn);
  }
  // Our connection to `rank` if it is still `where` (a call made on it may be cancelled there), else null.
  ConnectionPtr outgoing_if(int rank, const Connection* where) const {
    std::lock_guard lock(mutex_);
    if (rank < 0 || rank >= size() || outgoing_[rank].get() != where) return nullptr;
    return outgoing_[rank];
  }
  // Every connection we dialed that is still open.
  std::vector<ConnectionPtr> outgoing_connections() const {
    std::lock_guard lock(mutex_);
    std::vector<ConnectionPtr> out;
    for (const auto& c : outgoing_)
      if (c) out.push_back(c);
    return out;
  }

  // An accepted connection; false (and not added) once closing: the caller closes it.
  bool add_incoming(ConnectionPtr conn) {
    std::lock_guard lock(mutex_);
    if (closing_) return false;
    incoming_.insert(std::move(conn));
    return true;
  }

  // Lets `conn` speak for `rank` if no live connection does: nullopt if admitted (and conn->peer_rank set), else why
  // not. The one place that decides who speaks for a rank. `admitted` runs under the lock once admitted, so that what
  // the caller records with the admission (rank 0's registration) is one step with it.
  template <class Admitted>
  std::optional<std::string> claim(int rank, const ConnectionPtr& conn, Admitted&& admitted) {
    std::lock_guard lock(mutex_);
    if (auto held = holders_.find(rank); held != holders_.end())
      return "rank " + std::to_string(rank) + " is already connected here (from " + held->second->remote_address +
             "); one connection speaks for a rank at a time";
    holders_[rank] = conn;
    conn->peer_rank = rank;
    admitted();
    return std::nullopt;
  }
  std::optional<std::string> claim(int rank, const ConnectionPtr& conn) {
    return claim(rank, conn, [] {});
  }

  // What the loss of `conn` means to the table.
  struct Loss {
    bool while_closing = false;    // the runtime was closing already
    bool speaks_for_rank = false;  // ours, or the accepted connection that spoke for its rank
  };
  // Forgets `conn` (ours or accepted); releases the rank it spoke for.
  Loss remove(const ConnectionPtr& conn) {
    std::lock_guard lock(mutex_);
    const int rank = conn->peer_rank;
    Loss loss{closing_, false};
    incoming_.erase(conn);
    // Ours counts while it is still our connection to the rank: not once a new incarnation took the rank over.
    if (rank >= 0 && rank < size() && outgoing_[rank] == conn) {
      outgoing_[rank] = nullptr;
      loss.speaks_for_rank = true;
    }
    if (auto held = holders_.find(rank); held != holders_.end() && held->second == conn) {
      holders_.erase(held);
      loss.speaks_for_rank = true;
    }
    return loss;
  }

  // Records that `rank` is gone, `why`; returns our connection to it (still to be closed) if this is news, nullopt if
  // it was known gone already.
  std::optional<ConnectionPtr> mark_dead(int rank, const std::string& why) {
    std::lock_guard lock(mutex_);
    if (!dead_[rank].empty()) return std::nullopt;
    dead_[rank] = why;
    return outgoing_[rank];
  }
  bool is_alive(int rank) const {
    std::lock_guard lock(mutex_);
    return rank >= 0 && rank < size() && dead_[rank].empty();
  }
  // Why `rank` is gone ("" = alive).
  std::string death(int rank) const {
    std::lock_guard lock(mutex_);
    return rank >= 0 && rank < size() ? dead_[rank] : std::string();
  }
  // Why each rank is gone, by rank ("" = alive).
  std::vector<std::string> deaths() const {
    std::lock_guard lock(mutex_);
    return dead_;
  }

  // What a rank's Goodbye said: "" for an orderly shutdown, else the error it stops after.
  void set_farewell(int rank, std::string words) {
    std::lock_guard lock(mutex_);
    if (rank >= 0 && rank < size()) farewells_[rank] = std::move(words);
  }
  std::string farewell(int rank) const {
    std::lock_guard lock(mutex_);
    return rank >= 0 && rank < size() ? farewells_[rank] : std::string();
  }

  // From now on nothing is dialed or accepted; returns every connection, ours and accepted, to be closed.
  std::vector<ConnectionPtr> close() {
    std::lock_guard lock(mutex_);
    closing_ = true;
    std::vector<ConnectionPtr> all;
    for (const auto& c : outgoing_)
      if (c) all.push_back(c);
    all.insert(all.end(), incoming_.begin(), incoming_.end());
    return all;
  }
  // Whether any connection to another worker is still open (a loopback to `self` does not count).
  bool any_open(int self) const {
    std::lock_guard lock(mutex_);
    if (!incoming_.empty()) return true;
    for (const auto& c : outgoing_)
      if (c && c->peer_rank != self) return true;
    return false;
  }

 private:
  int size() const noexcept { return static_cast<int>(outgoing_.size()); }

  mutable std::mutex mutex_;
  std::vector<ConnectionPtr> outgoing_;  // by rank
  std::set<ConnectionPtr> incoming_;
  std::map<int, ConnectionPtr> holders_;  // by rank: the accepted connection that speaks for it
  std::vector<std::string> dead_;         // by rank
  std::vector<std::string> farewells_;    // by rank
  std::map<int, Address> moved_;          // ranks that rejoined since the world table: where they listen now
  bool closing_ = false;
};

}  // namespace corpc::detail
