// CUDA IPC between two workers on one host: a CUDA tensor bound for such a peer travels as a handle to its
// device memory instead of its bytes, and the peer copies it device to device. This header is the bookkeeping of one
// connection's IPC, torch- and CUDA-free so that it is unit-tested without a GPU; the CUDA calls are in the last part
// of src/memory/cuda_transfer.cpp (lending needs a CUDA libtorch: c10's caching allocator tells an allocation's base).
//
// Deciding (per connection, in the handshake, like the same-host channel it rides on): each Hello says whether its
// sender can do CUDA IPC (a CUDA build of libtorch, a device, CORPC_CUDA_IPC not 0, and the same-host channel on). A
// connection uses IPC only when both can and the same-host channel was set up on it: the channel proves one host,
// and is set up only over the authenticated connection, which is also the only way handles travel. The link is
// attached with the channel, before the channel can send, on both ends: whoever may send IPC entries finds its peer
// ready to accept them; a receiver without a link refuses them (ProtocolError).
//
// Lending (the sender, on the thread that sends): the tensor's allocation (base and offset from the caching
// allocator), an interprocess event recorded on the producer's current stream, and a loan id go in the tensor table
// (kTensorCudaIpc, tensor_meta.hpp); the tensor itself stays here, on loan, until the receiver's IpcDone frame names
// the id, or the connection is lost (then every loan of the link is released: nothing will ask for them again). A
// frame dropped before it reaches the wire (a call cancelled while it waited for room) returns its loans itself.
// Borrowing (the receiver, on the connection's I/O thread): the handle is opened once per process and kept while the
// link lives (its recent ones), the transfer stream waits for the event, copies into a tensor of its own caching
// allocator, and once the copy is done the IpcDone frame goes back on the same connection, before the message is
// delivered (a message whose connection was lost meanwhile is not: the lender may have reused the memory).
// Failures: a tensor the sender cannot lend goes by pinned-host staging; a failing CUDA call turns lending off for the
// pair, with one warning, and staging carries on. On the lender's side that tensor is staged too; on the borrower's,
// the message whose tensor could not be mapped fails (RpcError: its bytes never left the lender), and its IpcDone
// tells the lender to stop.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "corpc/wire/codec.hpp"

#include "wire/tensor_meta.hpp"

namespace corpc::detail {

// Whether a pair uses CUDA IPC, from what both announced: both can, and they are on one host (equal, known
// identities). The caller attaches the link only once the same-host channel is set up on that connection.
inline bool cuda_ipc_agreed(bool ours, const std::string& our_host, bool theirs, const std::string& their_host) {
  return ours && theirs && !our_host.empty() && our_host == their_host;
}

// Process-wide counters, so that tests see a silent fall-back to staging.
struct CudaIpcCounters {
  std::atomic<std::uint64_t> lent{0}, returned{0}, borrowed{0}, refused{0};
};
inline CudaIpcCounters& cuda_ipc_counters() {
  static CudaIpcCounters c;
  return c;
}

// The IpcDone frame's body: the loans the receiver is done with, and whether the sender must stop lending to it (it
// could not map what it was lent). [u8 stop][u32 count][count x u64 id].
struct IpcDone {
  bool stop_lending = false;
  std::vector<std::uint64_t> ids;
};
inline std::string encode_ipc_done(const IpcDone& d) {
  std::string body;
  Writer w(body);
  w.put(static_cast<std::uint8_t>(d.stop_lending ? 1 : 0));
  w.put(static_cast<std::uint32_t>(d.ids.size()));
  for (auto id : d.ids) w.put(id);
  return body;
}
// Throws ProtocolError if malformed.
inline IpcDone decode_ipc_done(const char* body, std::size_t size) {
  Reader r(body, size);
  IpcDone d;
  const auto stop = r.get<std::uint8_t>();
  if (stop > 1) throw ProtocolError("IpcDone: bad flag " + std::to_string(stop));
  d.stop_lending = stop == 1;
  for (auto n = r.count(sizeof(std::uint64_t)); n > 0; --n) d.ids.push_back(r.get<std::uint64_t>());
  if (r.remaining()) throw ProtocolError("IpcDone: trailing bytes");
  return d;
}

// One connection's CUDA IPC, both directions. Any thread; nothing here calls CUDA: what it keeps is type-erased, and
// released by dropping it (the CUDA side's deleters do the work, on the thread that drops them).
class CudaIpcLink {
 public:
  // `refused(why)` is called once per link, on the first failure of either direction (the runtime logs it).
  explicit CudaIpcLink(std::function<void(const std::string&)> refused = {}) : refused_(std::move(refused)) {}
  CudaIpcLink(const CudaIpcLink&) = delete;
  CudaIpcLink& operator=(const CudaIpcLink&) = delete;

  // ---- lending ----
  // Whether tensors may still be lent to the peer.
  bool lending() const noexcept { return lending_.load(std::memory_order_acquire) && !closed(); }
  // Lending failed: this tensor goes by staging, and with `for_good` every later one too.
  void lending_failed(const std::string& why, bool for_good) {
    if (for_good) lending_.store(false, std::memory_order_release);
    cuda_ipc_counters().refused.fetch_add(1, std::memory_order_relaxed);
    report(why);
  }
  // Keeps `loan` (what must outlive the peer's copy) until the peer returns the id it gets, or the link closes. After
  // close, the loan is released at once and the id is never used.
  std::uint64_t lend(std::shared_ptr<void> loan) {
    std::unique_lock lock(mutex_);
    const std::uint64_t id = ++next_id_;
    if (closed()) {
      lock.unlock();
      return id;  // `loan` is released on return: the frame cannot reach the peer
    }
    loans_.emplace(id, std::move(loan));
    cuda_ipc_counters().lent.fetch_add(1, std::memory_order_relaxed);
    return id;
  }
  // The peer is done with these (its IpcDone), or their frame never left: released on this thread. Unknown ids are
  // ignored (a loan returned already, or released by close).
  void returned(const std::vector<std::uint64_t>& ids) {
    std::vector<std::shared_ptr<void>> dead;
    {
      std::lock_guard lock(mutex_);
      for (auto id : ids)
        if (auto it = loans_.find(id); it != loans_.end()) {
          dead.push_back(std::move(it->second));
          loans_.erase(it);
        }
    }
    cuda_ipc_counters().returned.fetch_add(dead.size(), std::memory_order_relaxed);
  }
  std::size_t on_loan() const {
    std::lock_guard lock(mutex_);
    return loans_.size();
  }

  // ---- borrowing ----
  // What `open()` returned for `key` (a memory handle), opened on the first use (opening costs far more than a copy of
  // a small tensor) and kept while the link lives, the least recently used beyond kMaxMappings dropped: a mapping may
  // keep memory the lender has freed (its allocator's empty_cache, or a retry after running out) from going back to
  // the device, so only the lender's working set of allocations stays mapped. Throws what `open` throws.
  static constexpr std::size_t kMaxMappings = 64;
  std::shared_ptr<void> mapping(const CudaIpcHandle& key, const std::function<std::shared_ptr<void>()>& open) {
    std::shared_ptr<void> evicted;  // dropped outside the lock
    {
      std::lock_guard lock(mutex_);
      if (auto it = mappings_.find(key); it != mappings_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second.second);
        return it->second.first;
      }
    }
    auto opened = open();
    std::lock_guard lock(mutex_);
    if (closed()) return opened;  // used by the copy at hand only
    auto [it, fresh] = mappings_.try_emplace(key, opened, lru_.end());
    if (!fresh) return it->second.first;  // opened twice concurrently: both are the process's one mapping
    lru_.push_front(key);
    it->second.second = lru_.begin();
    if (mappings_.size() > kMaxMappings) {
      auto last = mappings_.find(lru_.back());
      evicted = std::move(last->second.first);
      mappings_.erase(last);
      lru_.pop_back();
    }
    return opened;
  }
  // Borrowing failed (a handle or event could not be opened): the next IpcDone tells the peer to stop lending.
  void borrowing_failed(const std::string& why) {
    stop_asked_.store(true, std::memory_order_release);
    cuda_ipc_counters().refused.fetch_add(1, std::memory_order_relaxed);
    report(why);
  }
  bool ask_peer_to_stop() const noexcept { return stop_asked_.load(std::memory_order_acquire); }

  // ---- both ----
  // The connection is gone: every loan is released (nothing will return them), and the mappings are closed once the
  // copies that still use them are done. Lending stops. Idempotent.
  void close() {
    std::map<std::uint64_t, std::shared_ptr<void>> loans;
    std::map<CudaIpcHandle, std::pair<std::shared_ptr<void>, std::list<CudaIpcHandle>::iterator>> mappings;
    {
      std::lock_guard lock(mutex_);
      closed_.store(true, std::memory_order_release);
      loans.swap(loans_);
      mappings.swap(mappings_);
      lru_.clear();
    }
  }
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }

 private:
  void report(const std::string& why) {
    if (!reported_.exchange(true) && refused_) refused_(why);
  }

  std::function<void(const std::string&)> refused_;
  std::atomic<bool> reported_{false};
  std::atomic<bool> lending_{true};
  std::atomic<bool> stop_asked_{false};
  std::atomic<bool> closed_{false};  // set under mutex_, so that nothing is kept after close
  mutable std::mutex mutex_;         // guards what follows
  std::uint64_t next_id_ = 0;
  std::map<std::uint64_t, std::shared_ptr<void>> loans_;
  std::map<CudaIpcHandle, std::pair<std::shared_ptr<void>, std::list<CudaIpcHandle>::iterator>> mappings_;
  std::list<CudaIpcHandle> lru_;  // most recently used first
};

// The loans of one outgoing frame: returned to the link if the frame is dropped before the connection takes it (a
// call cancelled or timed out while it waited for room, a limit refused after framing); once committed (the
// connection queued it for the wire) they stay out until the peer's IpcDone or the connection's loss.
class CudaIpcLoans {
 public:
  explicit CudaIpcLoans(std::shared_ptr<CudaIpcLink> link) : link_(std::move(link)) {}
  CudaIpcLoans(const CudaIpcLoans&) = delete;
  CudaIpcLoans& operator=(const CudaIpcLoans&) = delete;
  ~CudaIpcLoans() {
    if (!committed_.load(std::memory_order_acquire) && !ids_.empty()) link_->returned(ids_);
  }
  void add(std::uint64_t id, std::uint64_t bytes) {
    ids_.push_back(id);
    bytes_ += bytes;
  }
  void commit() noexcept { committed_.store(true, std::memory_order_release); }
  const std::vector<std::uint64_t>& ids() const noexcept { return ids_; }
  // The tensor bytes lent (the receiver's limits count them as if they travelled).
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  std::shared_ptr<CudaIpcLink> link_;
  std::vector<std::uint64_t> ids_;
  std::uint64_t bytes_ = 0;
  std::atomic<bool> committed_{false};
};

// The tensors of one received message that were lent by CUDA IPC: their index in Message::tensors (where a 0-byte
// placeholder stands) and their entry, and the link they came on (its mappings, its IpcDone).
struct CudaIpcArrivals {
  std::shared_ptr<CudaIpcLink> link;
  std::vector<std::pair<std::size_t, TensorMeta>> tensors;
  std::vector<std::uint64_t> ids() const {
    std::vector<std::uint64_t> out;
    for (const auto& [i, m] : tensors) out.push_back(m.ipc->id);
    return out;
  }
};

}  // namespace corpc::detail
