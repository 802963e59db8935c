// Executors, the blocking rules and the thread-local "current" pointers of corpc/core.
#include "corpc/core/executor.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <climits>
#include <ctime>

#include "corpc/core/call_context.hpp"
#include "corpc/core/detail/deferred_work.hpp"
#include "corpc/core/detail/event.hpp"
#include "corpc/core/detail/manual_executor.hpp"
#include "corpc/core/errors.hpp"

namespace corpc {

namespace {
thread_local Executor* tls_executor = nullptr;
thread_local bool tls_no_blocking = false;
thread_local ThreadPool* tls_pool = nullptr;  // the pool whose thread this is
std::atomic<Executor*> g_default_executor{nullptr};
std::atomic<std::int64_t> g_spin_ns{50'000};

void futex_wait(std::atomic<std::uint32_t>& word, std::uint32_t expected, const timespec* relative) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, relative, nullptr, 0);
}
void futex_wake(std::atomic<std::uint32_t>& word, int count) noexcept {
  ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, count, nullptr, nullptr, 0);
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Spins until `ready()` or the spin budget is spent; true if ready.
template <class Ready>
bool spin(Ready ready) noexcept {
  const auto budget = g_spin_ns.load(std::memory_order_relaxed);
  if (budget <= 0) return ready();
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(budget);
  for (int i = 0;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= until) return ready();
  }
}

struct FunctionJob : WorkItem {
  std::function<void()> fn;
  static void invoke(WorkItem* w) noexcept {
    auto* self = static_cast<FunctionJob*>(w);
    try {
      self->fn();
    } catch (...) {
      // Posted jobs report their own errors (through the futures they complete); one must not take a thread down.
    }
    delete self;
  }
};
}  // namespace

void Executor::post(std::function<void()> job) {
  auto* item = new FunctionJob;
  item->fn = std::move(job);
  item->run = &FunctionJob::invoke;
  enqueue(item);
}

Executor* current_executor() noexcept { return tls_executor; }
ExecutorScope::ExecutorScope(Executor* e) noexcept : previous_(tls_executor) { tls_executor = e; }
ExecutorScope::~ExecutorScope() { tls_executor = previous_; }

void set_default_executor(Executor* e) noexcept { g_default_executor.store(e, std::memory_order_release); }
Executor* default_executor() noexcept { return g_default_executor.load(std::memory_order_acquire); }

detail::NonBlockingThreadScope::NonBlockingThreadScope() noexcept : previous_(tls_no_blocking) {
  tls_no_blocking = true;
}
detail::NonBlockingThreadScope::~NonBlockingThreadScope() { tls_no_blocking = previous_; }
bool blocking_forbidden() noexcept { return tls_no_blocking; }
void check_may_block(const char* what) {
  if (tls_no_blocking)
    throw UsageError(std::string(what) +
                     " would block a corpc I/O thread, which must deliver the very value it waits for: co_await it "
                     "instead, or run this function on the worker pool (the default)");
  if (detail::tls_work_deferred) detail::run_deferred_work();
}

namespace {
std::atomic<detail::DeferredWork> g_deferred_work{nullptr};
}

void detail::set_deferred_work(DeferredWork fn) noexcept { g_deferred_work.store(fn, std::memory_order_release); }

void detail::run_deferred_work() noexcept {
  tls_work_deferred = false;
  if (auto fn = g_deferred_work.load(std::memory_order_acquire)) fn();
}

void detail::set_spin_before_block(std::chrono::nanoseconds d) noexcept {
  g_spin_ns.store(d.count(), std::memory_order_relaxed);
}
std::chrono::nanoseconds detail::spin_before_block() noexcept { return std::chrono::nanoseconds(g_spin_ns.load()); }

// ---- Event ------------------------------------------------------------------------------------------------------

void detail::Event::set() noexcept {
  if (state_.exchange(kSet, std::memory_order_acq_rel) == kSleeping) futex_wake(state_, INT_MAX);
}

void detail::Event::wait() noexcept {
  if (spin([&] { return is_set(); })) return;
  BlockingRegion blocking;
  for (;;) {
    std::uint32_t s = kEmpty;
    if (!state_.compare_exchange_strong(s, kSleeping, std::memory_order_acq_rel) && s == kSet) return;
    futex_wait(state_, kSleeping, nullptr);
    if (is_set()) return;
  }
}

bool detail::Event::wait_until(std::chrono::steady_clock::time_point deadline) noexcept {
  if (spin([&] { return is_set(); })) return true;
  BlockingRegion blocking;
  for (;;) {
    std::uint32_t s = kEmpty;
    if (!state_.compare_exchange_strong(s, kSleeping, std::memory_order_acq_rel) && s == kSet) return true;
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero()) return is_set();
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    futex_wait(state_, kSleeping, &ts);
    if (is_set()) return true;
  }
}

// ---- ThreadPool -------------------------------------------------------------------------------------------------

detail::BlockingRegion::BlockingRegion() noexcept : pool_(tls_pool) {
  if (pool_) pool_->block_begin();
}
detail::BlockingRegion::~BlockingRegion() {
  if (pool_) pool_->block_end();
}

ThreadPool::ThreadPool(std::size_t threads, std::function<void()> on_start, std::size_t max_threads)
    : on_start_(std::move(on_start)), base_(threads ? threads : 1), max_(std::max(max_threads, base_)) {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < base_; ++i) start_thread();
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::start_thread() {
  ++live_;
  ++started_;
  threads_.emplace_back([this] { run(); });
}

std::size_t ThreadPool::threads_started() const noexcept {
  std::lock_guard lock(mutex_);
  return started_;
}

bool ThreadPool::running_here() const noexcept { return tls_pool == this; }

void ThreadPool::enqueue(WorkItem* item) noexcept {
  item->next = nullptr;
  bool wake;
  {
    std::lock_guard lock(mutex_);
    if (tail_) tail_->next = item;
    else head_ = item;
    tail_ = item;
    wake = idle_ > 0;
    // Every thread is busy and some are blocked: keep `base_` threads runnable.
    if (!wake && live_ - blocked_ < base_ && live_ < max_ && !stopping_) start_thread();
    // Notify under the lock: once it is released, the job may run, let its owner stop and destroy this pool, and
    // take cv_ with it before a late notify (ThreadSanitizer saw exactly that).
    if (wake) cv_.notify_one();
  }
}

void ThreadPool::block_begin() {
  std::lock_guard lock(mutex_);
  ++blocked_;
  if (head_ && idle_ == 0 && live_ - blocked_ < base_ && live_ < max_ && !stopping_) start_thread();
}

void ThreadPool::block_end() {
  std::lock_guard lock(mutex_);
  --blocked_;
}

void ThreadPool::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  // Threads may still be started while the queue drains (replacements): join until none is left.
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      threads.swap(threads_);
    }
    if (threads.empty()) break;
    for (auto& t : threads) {
      if (t.get_id() == std::this_thread::get_id()) t.detach();
      else if (t.joinable()) t.join();
    }
    threads.clear();
  }
}

void ThreadPool::run() {
  ExecutorScope scope(this);
  tls_pool = this;
  if (on_start_) on_start_();
  std::unique_lock lock(mutex_);
  for (;;) {
    if (!head_) {
      // A replacement started while others were blocked retires once they are runnable again.
      if (stopping_ || live_ - blocked_ > base_) break;
      ++idle_;
      cv_.wait(lock, [&] { return head_ || stopping_; });
      --idle_;
      continue;
    }
    WorkItem* item = head_;
    head_ = item->next;
    if (!head_) tail_ = nullptr;
    lock.unlock();
    item->run(item);
    if (detail::tls_work_deferred) detail::run_deferred_work();  // what the job sent leaves before the next job
    // A job must not leak its ambient context into the next one on this thread.
    current_call_context() = CallContext{};
    lock.lock();
  }
  --live_;
  tls_pool = nullptr;
}

// ---- BoundedExecutor ------------------------------------------------------------------------------------------

BoundedExecutor::~BoundedExecutor() {
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] { return running_ == 0; });
  for (auto* r : free_runners_) delete r;
}

void BoundedExecutor::enqueue(WorkItem* item) noexcept {
  item->next = nullptr;
  Runner* runner;
  {
    std::lock_guard lock(mutex_);
    if (running_ == width_) {
      if (tail_) tail_->next = item;
      else head_ = item;
      tail_ = item;
      return;
    }
    ++running_;
    if (free_runners_.empty()) {
      runner = new Runner;
      runner->owner = this;
      runner->run = &BoundedExecutor::run_one;
    } else {
      runner = free_runners_.back();
      free_runners_.pop_back();
    }
    runner->job = item;
  }
  underlying_.enqueue(runner);
}

void BoundedExecutor::run_one(WorkItem* w) noexcept {
  auto* runner = static_cast<Runner*>(w);
  BoundedExecutor* self = runner->owner;
  {
    ExecutorScope scope(self);  // continuations the job registers come back through this executor
    runner->job->run(runner->job);
  }
  {
    std::lock_guard lock(self->mutex_);
    if (WorkItem* next = self->head_) {
      // Take the next job now, under the lock: a runner that only looked at the queue here and popped it on its next
      // turn could find it taken by another runner that finished at the same moment.
      self->head_ = next->next;
      if (!self->head_) self->tail_ = nullptr;
      runner->job = next;
    } else {
      runner->job = nullptr;
      --self->running_;
      self->free_runners_.push_back(runner);
      // Notify under the lock: the owner may destroy this executor as soon as it sees running_ == 0.
      if (self->running_ == 0) self->drained_.notify_all();
      return;
    }
  }
  self->underlying_.enqueue(runner);
}

// ---- ManualExecutor ---------------------------------------------------------------------------------------------

void detail::ManualExecutor::enqueue(WorkItem* item) noexcept {
  WorkItem* head = inbox_.load(std::memory_order_relaxed);
  do {
    item->next = head;
  } while (!inbox_.compare_exchange_weak(head, item, std::memory_order_release, std::memory_order_relaxed));
  notify();
}

void detail::ManualExecutor::notify() noexcept {
  wake_.fetch_add(1, std::memory_order_release);
  if (sleeping_.load(std::memory_order_seq_cst)) futex_wake(wake_, 1);
}

void detail::ManualExecutor::run_until(const std::atomic<bool>& done) {
  const bool outermost = owner_ != std::this_thread::get_id();  // sync_wait may nest on one thread
  owner_ = std::this_thread::get_id();
  for (;;) {
    const std::uint32_t seen = wake_.load(std::memory_order_acquire);
    WorkItem* batch = inbox_.exchange(nullptr, std::memory_order_acquire);
    if (batch) {
      WorkItem* fifo = nullptr;  // the stack is newest-first: reverse it
      while (batch) {
        WorkItem* next = batch->next;
        batch->next = fifo;
        fifo = batch;
        batch = next;
      }
      while (fifo) {
        WorkItem* next = fifo->next;
        fifo->run(fifo);
        fifo = next;
      }
      continue;
    }
    if (done.load(std::memory_order_acquire)) break;  // done, and nothing left that could touch the caller's frame
    if (spin([&] { return wake_.load(std::memory_order_acquire) != seen; })) continue;
    BlockingRegion blocking;
    sleeping_.store(true, std::memory_order_seq_cst);
    if (wake_.load(std::memory_order_seq_cst) == seen) futex_wait(wake_, seen, nullptr);
    sleeping_.store(false, std::memory_order_relaxed);
  }
  if (outermost) owner_ = {};
}

}  // namespace corpc

namespace corpc {
namespace {
thread_local CallContext tls_call_context{};
std::atomic<int> g_next_slot{0};
}  // namespace

CallContext& current_call_context() noexcept { return tls_call_context; }

int CallContext::new_slot() {
  const int s = g_next_slot.fetch_add(1);
  if (s >= kSlots) throw UsageError("CallContext: all " + std::to_string(kSlots) + " slots are taken");
  return s;
}
}  // namespace corpc
