// corpc/core/detail/block_cache.hpp — per-thread recycling of fixed-size blocks, for the shared states of futures
// (internal).
#pragma once

#include <atomic>
#include <cstddef>
#include <new>

namespace corpc::detail {

// Recycles blocks of one size per thread, so that steady-state calls take no trip to the heap. A block freed on
// another thread (a reply completes on an I/O thread, the caller drops the future on its own) goes back to the cache
// of the thread that allocated it, through a lock-free list that the owner drains when its own list is empty.
//
// Lifetime: a cache outlives its thread while blocks it issued are still alive elsewhere. At thread exit the owner
// closes the remote list (one atomic exchange, so no block can be pushed after the last drain), frees what it holds,
// and hands the count of blocks still out to `outstanding`; each of those, freed later on another thread, finds the
// list closed, frees itself and counts down; whoever brings the count to zero deletes the cache. Nothing leaks, and
// the fast paths (allocate and free on the owner thread) stay free of atomic read-modify-writes.
template <std::size_t Size>
class BlockCache {
  struct Cache;
  struct alignas(16) Header {
    Cache* owner;  // null: allocated after its thread's cache was closed, freed straight to the heap
    Header* next;
  };

 public:
  static void* allocate() {
    Cache* c = local();
    Header* h;
    if (c && !c->count) c->drain_remote();
    if (c && c->count) {
      h = c->blocks[--c->count];
    } else {
      h = static_cast<Header*>(::operator new(sizeof(Header) + Size));
      h->owner = c;
      if (c) ++c->issued;
    }
    return h + 1;
  }
  static void deallocate(void* p) noexcept {
    Header* h = static_cast<Header*>(p) - 1;
    Cache* owner = h->owner;
    if (!owner) return ::operator delete(h);
    if (owner == tls_cache) {
      if (owner->count < kKeep) return void(owner->blocks[owner->count++] = h);
      --owner->issued;
      return ::operator delete(h);
    }
    Header* head = owner->remote.load(std::memory_order_relaxed);
    do {
      if (head == closed()) {
        ::operator delete(h);
        return owner->release(1);
      }
      h->next = head;
    } while (!owner->remote.compare_exchange_weak(head, h, std::memory_order_release, std::memory_order_relaxed));
  }

 private:
  static constexpr std::size_t kKeep = 256;
  static Header* closed() noexcept { return reinterpret_cast<Header*>(alignof(Header)); }  // never a real block
  struct Cache {
    Header* blocks[kKeep];
    std::size_t count = 0;
    std::size_t issued = 0;  // blocks this cache made and the owner has not given back to the heap (owner only)
    std::atomic<Header*> remote{nullptr};
    std::atomic<std::ptrdiff_t> outstanding{0};
    void take(Header* list) noexcept {
      for (Header* h = list; h;) {
        Header* next = h->next;
        if (count < kKeep) {
          blocks[count++] = h;
        } else {
          --issued;
          ::operator delete(h);
        }
        h = next;
      }
    }
    void drain_remote() noexcept { take(remote.exchange(nullptr, std::memory_order_acquire)); }
    // Counts `n` blocks as given back; the last one deletes the cache (see the lifetime note above).
    void release(std::ptrdiff_t n) noexcept {
      if (outstanding.fetch_sub(n, std::memory_order_acq_rel) == n) delete this;
    }
    void close() noexcept {
      take(remote.exchange(closed(), std::memory_order_acquire));
      while (count) {
        --issued;
        ::operator delete(blocks[--count]);
      }
      // `outstanding` went negative by the blocks freed elsewhere meanwhile; adding what is still out (plus this
      // call's own count, released at once) balances it.
      outstanding.fetch_add(static_cast<std::ptrdiff_t>(issued) + 1, std::memory_order_acq_rel);
      release(1);
    }
  };
  struct Guard {
    Cache* cache = new Cache;
    ~Guard() {
      tls_cache = nullptr;
      tls_closed = true;
      cache->close();
    }
  };
  static inline thread_local Cache* tls_cache = nullptr;
  static inline thread_local bool tls_closed = false;  // this thread's guard is gone: use the heap directly
  static Cache* local() {
    if (!tls_cache && !tls_closed) {
      static thread_local Guard guard;
      tls_cache = guard.cache;
    }
    return tls_cache;
  }
};

}  // namespace corpc::detail
