// corpc/rref/detail/context.hpp — the RRef protocol's state on one worker (the protocol: corpc/rref/context.hpp):
// the values it owns, the user references it holds, the forks it waits on. Defined in src/rref/context.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "corpc/core/future.hpp"
#include "corpc/rpc/runtime.hpp"
#include "corpc/rref/context.hpp"

namespace corpc {

namespace detail {

// An id unique across the job: the rank that made it and a counter of that worker's.
struct GloballyUniqueId {
  std::int32_t rank = -1;                                     // the worker that made it
  std::int64_t local_id = -1;                                 // unique among the ids that worker made
  auto operator<=>(const GloballyUniqueId&) const = default;  // by rank, then local_id
  CORPC_FIELDS(rank, local_id)
};
using RRefId = GloballyUniqueId;  // a value held through RRefs (the same on every worker)
using ForkId = GloballyUniqueId;  // one user reference (fork) of such a value

// A value on its owner. `value` points at the T; `ready` completes when it is set (or failed).
struct OwnerSlot {
  RRefId id;
  std::uint64_t type_hash = 0;  // 0 until created
  std::shared_ptr<void> value;
  Promise<void> ready_promise;
  Future<void> ready = ready_promise.get_future();
  std::map<ForkId, int> forks;  // fork -> the worker that holds it
  int local_handles = 0;        // RRefState objects on the owner
  bool created = false;         // a creation (remote(), local RRef) has claimed this slot; guarded by the context

  // One call at a time, in dispatch order, for objects that opt into serialized calls (see RRef).
  std::mutex serial_mutex;
  std::deque<std::function<void()>> serial_queue;
  bool serial_busy = false;
};

class RRefContext;

// What an RRef<T> handle points at; shared by the copies of one reference in one process.
struct RRefState {
  RRefId id;
  ForkId fork;  // users: this reference's fork; owners: unused
  int owner = -1;
  bool is_owner = false;
  std::uint64_t type_hash = 0;
  std::shared_ptr<OwnerSlot> slot;  // owners only
  // Users: completes when the owner has recorded this reference, or fails if creation could not be confirmed.
  // Shared, so that a reply arriving after user code dropped the reference still confirms it (and its delete goes).
  std::shared_ptr<Promise<void>> confirm_promise = std::make_shared<Promise<void>>();
  Future<void> confirmed = confirm_promise->get_future();
  std::weak_ptr<RRefContext> context;
  ~RRefState();
};

class RRefContext : public std::enable_shared_from_this<RRefContext> {
 public:
  explicit RRefContext(Runtime& rt);
  static std::shared_ptr<RRefContext> get() { return Runtime::get().extension<RRefContext>(); }

  int self() const noexcept { return self_; }
  RRefId new_id();

  // Owner side.
  std::shared_ptr<OwnerSlot> slot(const RRefId& id);  // creates an empty slot if none: messages may overtake creation
  std::shared_ptr<RRefState> owner_handle(const RRefId& id, std::uint64_t type_hash);
  void add_fork(const RRefId& id, const ForkId& fork, int holder);
  void remove_fork(const RRefId& id, const ForkId& fork);
  // Stores the value (or the error) of a slot and wakes everyone waiting for it.
  void fulfil(const std::shared_ptr<OwnerSlot>& slot, std::shared_ptr<void> value, std::uint64_t type_hash);
  void fail(const std::shared_ptr<OwnerSlot>& slot, std::exception_ptr error);
  // A creation has claimed this slot (until then it is a placeholder that is never freed).
  void claim(const std::shared_ptr<OwnerSlot>& slot);
  // A creation request that could not even be decoded: its waiters get `error`, and the slot goes.
  void abandon_creation(const RRefId& id, std::exception_ptr error);

  // User side.
  std::shared_ptr<RRefState> new_user(const RRefId& id, const ForkId& fork, int owner, std::uint64_t type_hash);

  // Sharing (see the protocol above). Encode: called by the sender; returns the fork to put on the wire.
  ForkId fork_for(const std::shared_ptr<RRefState>& state, int destination);
  // Decode: called by the receiver; returns the handle to give to user code.
  std::shared_ptr<RRefState> receive(const RRefId& id, const ForkId& fork, int owner, int sender,
                                     std::uint64_t type_hash);
  void accept_child(const ForkId& fork);

  // Serialized calls on an owned object: runs `job` after every earlier one on the same slot has finished.
  Future<void> run_serialized(const std::shared_ptr<OwnerSlot>& slot, std::function<Future<void>()> job);

  RRefStats stats() const;

  // Called from ~RRefState.
  void release(RRefState& state);

 private:
  void free_if_unreferenced(const RRefId& id);
  void start_next(const std::shared_ptr<OwnerSlot>& slot);
  void on_peer_failure(int rank);

  Runtime& runtime_;
  int self_;
  std::atomic<std::int64_t> next_id_{1};
  mutable std::mutex mutex_;
  std::map<RRefId, std::shared_ptr<OwnerSlot>> owned_;
  std::map<ForkId, std::pair<std::shared_ptr<RRefState>, int>> pending_children_;  // fork -> (parent, destination)
  std::atomic<std::int64_t> user_refs_{0};
  std::atomic<std::int64_t> unconfirmed_{0};
};

}  // namespace detail

}  // namespace corpc
