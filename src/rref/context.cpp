// RRef bookkeeping: owner slots, forks, confirmations, deletions, and their control messages.
#include "corpc/rref/detail/context.hpp"

#include "corpc/rpc/call.hpp"

namespace corpc {

namespace detail {
// ---- control messages (ordinary RPCs sent from the runtime's background scope, so graceful shutdown waits for them
// and a stop requested on the work that dropped a reference does not cancel its delete) ----
void rref_fork_request(RRefId id, ForkId fork, int holder, int parent);
void rref_child_accept(ForkId fork);
void rref_delete(RRefId id, ForkId fork);
RRefStats rref_stats_here();
}  // namespace detail

RRefStats rref_stats() { return detail::RRefContext::get()->stats(); }
Future<RRefStats> rref_stats(const WorkerRef& worker) { return rpc_async<&detail::rref_stats_here>(worker); }

namespace detail {

void rref_fork_request(RRefId id, ForkId fork, int holder, int parent) {
  auto ctx = RRefContext::get();
  ctx->add_fork(id, fork, holder);
  // The parent may now let go of its own reference (G2). A parent that is the holder itself learns it from our reply.
  if (parent != ctx->self() && parent != holder) send_control<&rref_child_accept>(parent, fork);
}
void rref_child_accept(ForkId fork) { RRefContext::get()->accept_child(fork); }
void rref_delete(RRefId id, ForkId fork) { RRefContext::get()->remove_fork(id, fork); }
RRefStats rref_stats_here() { return RRefContext::get()->stats(); }

namespace {

// Tells the owner that a user reference is gone (G1). Not confirmed yet: the owner may not know this fork, so the
// delete waits for the confirmation. One that timed out may still have been recorded: delete then too (deletes are
// idempotent). One that failed because the owner is gone or refused needs nothing.
Task<void> delete_fork(Future<void> confirmed, RRefId id, ForkId fork, int owner) {
  try {
    co_await confirmed;
  } catch (const TimeoutError&) {
  } catch (...) {
    co_return;
  }
  try {
    co_await rpc_async<&rref_delete>(owner, id, fork);
  } catch (...) {
    // The owner died or this worker is shutting down: its bookkeeping goes with it.
  }
}

}  // namespace

RRefState::~RRefState() {
  if (auto ctx = context.lock()) ctx->release(*this);
}

RRefContext::RRefContext(Runtime& rt) : runtime_(rt), self_(rt.rank()) {
  rt.add_peer_failure_listener([this](int rank, const std::string&) { on_peer_failure(rank); });
}

RRefId RRefContext::new_id() { return RRefId{self_, next_id_.fetch_add(1)}; }

std::shared_ptr<OwnerSlot> RRefContext::slot(const RRefId& id) {
  std::lock_guard lock(mutex_);
  auto& s = owned_[id];
  if (!s) {
    s = std::make_shared<OwnerSlot>();
    s->id = id;
  }
  return s;
}

std::shared_ptr<RRefState> RRefContext::owner_handle(const RRefId& id, std::uint64_t type_hash) {
  auto s = slot(id);
  auto state = std::make_shared<RRefState>();
  state->id = id;
  state->owner = self_;
  state->is_owner = true;
  state->type_hash = type_hash;
  state->slot = s;
  state->confirm_promise->set_value();
  state->context = weak_from_this();
  std::lock_guard lock(mutex_);
  s->local_handles++;
  return state;
}

void RRefContext::add_fork(const RRefId& id, const ForkId& fork, int holder) {
  auto s = slot(id);
  std::lock_guard lock(mutex_);
  s->forks.emplace(fork, holder);  // idempotent
}

void RRefContext::remove_fork(const RRefId& id, const ForkId& fork) {
  {
    std::lock_guard lock(mutex_);
    auto it = owned_.find(id);
    if (it == owned_.end()) return;  // already freed: deletes are idempotent
    it->second->forks.erase(fork);
  }
  free_if_unreferenced(id);
}

void RRefContext::free_if_unreferenced(const RRefId& id) {
  std::shared_ptr<OwnerSlot> freed;  // destroyed outside the lock: the value's destructor may do anything
  std::lock_guard lock(mutex_);
  auto it = owned_.find(id);
  // An unclaimed slot (made by a message that overtook the creation) stays until the creation arrives: someone may
  // be waiting on it. on_peer_failure fails and frees it if its creator dies first.
  if (it == owned_.end() || !it->second->forks.empty() || it->second->local_handles > 0 || !it->second->created) return;
  freed = std::move(it->second);
  owned_.erase(it);
}

void RRefContext::fulfil(const std::shared_ptr<OwnerSlot>& s, std::shared_ptr<void> value, std::uint64_t type_hash) {
  {
    std::lock_guard lock(mutex_);
    s->value = std::move(value);
    s->type_hash = type_hash;
  }
  s->ready_promise.set_value();
}

void RRefContext::fail(const std::shared_ptr<OwnerSlot>& s, std::exception_ptr error) {
  s->ready_promise.set_exception(std::move(error));
}

std::shared_ptr<RRefState> RRefContext::new_user(const RRefId& id, const ForkId& fork, int owner,
                                                 std::uint64_t type_hash) {
  auto state = std::make_shared<RRefState>();
  state->id = id;
  state->fork = fork;
  state->owner = owner;
  state->type_hash = type_hash;
  state->context = weak_from_this();
  user_refs_++;
  unconfirmed_++;
  detail::on_ready_inline(state->confirmed, [self = weak_from_this()] {
    if (auto ctx = self.lock()) ctx->unconfirmed_--;
  });
  return state;
}

ForkId RRefContext::fork_for(const std::shared_ptr<RRefState>& state, int destination) {
  ForkId fork = new_id();
  if (state->owner == self_) {  // an owner handle, or a user reference to a value we own (remote() to ourselves)
    add_fork(state->id, fork, destination);  // in transit: the owner knows at once
  } else {
    std::lock_guard lock(mutex_);
    pending_children_[fork] = {state, destination};
  }
  return fork;
}

std::shared_ptr<RRefState> RRefContext::receive(const RRefId& id, const ForkId& fork, int owner, int sender,
                                                std::uint64_t type_hash) {
  if (owner == self_) {
    auto handle = owner_handle(id, type_hash);  // take our handle before dropping the in-transit fork
    if (sender == self_) {
      remove_fork(id, fork);
    } else {
      send_control<&rref_child_accept>(sender, fork);
    }
    return handle;
  }
  auto state = new_user(id, fork, owner, type_hash);
  if (sender == owner) {
    state->confirm_promise->set_value();  // the owner recorded this fork before sending it
  } else {
    auto reply = rpc_async<&rref_fork_request>(owner, id, fork, self_, sender);
    const bool own_child = sender == self_;
    detail::on_ready_inline(reply, [reply, confirm = state->confirm_promise, own_child, fork, weak = weak_from_this()] {
      if (auto e = reply.error()) confirm->set_exception(e);
      else confirm->set_value();
      if (auto ctx = weak.lock(); ctx && own_child) ctx->accept_child(fork);
    });
  }
  return state;
}

void RRefContext::accept_child(const ForkId& fork) {
  std::shared_ptr<RRefState> parent;  // released outside the lock: it may send a delete
  std::lock_guard lock(mutex_);
  auto it = pending_children_.find(fork);
  if (it == pending_children_.end()) return;
  parent = std::move(it->second.first);
  pending_children_.erase(it);
}

void RRefContext::release(RRefState& state) {
  if (state.is_owner) {
    {
      std::lock_guard lock(mutex_);
      if (state.slot) state.slot->local_handles--;
    }
    free_if_unreferenced(state.id);
    return;
  }
  user_refs_--;
  auto* rt = Runtime::try_get();
  if (!rt) return;
  (void)rt->spawn_background(delete_fork(state.confirmed, state.id, state.fork, state.owner));
}

Future<void> RRefContext::run_serialized(const std::shared_ptr<OwnerSlot>& s, std::function<Future<void>()> job) {
  auto done = std::make_shared<Promise<void>>();
  auto result = done->get_future();
  auto weak = weak_from_this();
  std::function<void()> wrapped = [weak, s, job = std::move(job), done] {
    Future<void> f;
    try {
      f = job();
    } catch (...) {
      f = make_exceptional_future<void>(std::current_exception());
    }
    detail::on_ready_inline(f, [weak, s, f, done] {
      if (auto e = f.error()) done->set_exception(e);
      else done->set_value();
      if (auto ctx = weak.lock()) ctx->start_next(s);
    });
  };
  bool start = false, here = false;
  {
    std::lock_guard lock(s->serial_mutex);
    if (!s->serial_busy) {
      start = s->serial_busy = true;
      // The first call of an idle object, asked for on the worker pool (a proxy call's handler, which would only
      // wait for it), starts here: handing it to another pool thread would cost a wake-up and gain nothing.
      here = runtime_.executor().running_here();
    }
    if (!here) s->serial_queue.push_back(std::move(wrapped));
  }
  if (here) wrapped();
  else if (start) start_next(s);
  return result;
}

// Runs the next queued call on the worker pool (never on whichever thread finished the previous one).
void RRefContext::start_next(const std::shared_ptr<OwnerSlot>& s) {
  std::function<void()> next;
  {
    std::lock_guard lock(s->serial_mutex);
    if (s->serial_queue.empty()) {
      s->serial_busy = false;
      return;
    }
    next = std::move(s->serial_queue.front());
    s->serial_queue.pop_front();
  }
  runtime_.executor().post(std::move(next));
}

RRefStats RRefContext::stats() const {
  std::lock_guard lock(mutex_);
  return RRefStats{owned_.size(), static_cast<std::uint64_t>(user_refs_.load()),
                   pending_children_.size() + static_cast<std::uint64_t>(unconfirmed_.load())};
}

void RRefContext::claim(const std::shared_ptr<OwnerSlot>& s) {
  std::lock_guard lock(mutex_);
  s->created = true;
}

void RRefContext::abandon_creation(const RRefId& id, std::exception_ptr error) {
  auto s = slot(id);
  claim(s);
  fail(s, std::move(error));
  free_if_unreferenced(id);
}

void RRefContext::on_peer_failure(int rank) {
  std::vector<RRefId> touched;
  std::vector<std::shared_ptr<RRefState>> dropped;
  std::vector<std::shared_ptr<OwnerSlot>> orphans;  // placeholders whose creator is gone
  {
    std::lock_guard lock(mutex_);
    for (auto& [id, s] : owned_) {
      if (!s->created && id.rank == rank) {
        s->created = true;
        orphans.push_back(s);
        touched.push_back(id);
      }
      for (auto it = s->forks.begin(); it != s->forks.end();) {
        if (it->second == rank) {
          it = s->forks.erase(it);
          touched.push_back(id);
        } else {
          ++it;
        }
      }
    }
    for (auto it = pending_children_.begin(); it != pending_children_.end();) {
      if (it->second.second == rank || it->second.first->owner == rank) {
        dropped.push_back(std::move(it->second.first));
        it = pending_children_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& s : orphans)
    fail(s,
         std::make_exception_ptr(ConnectionError("the creator of this RRef (rank " + std::to_string(rank) + ") died")));
  for (auto& id : touched) free_if_unreferenced(id);
}

}  // namespace detail
}  // namespace corpc
