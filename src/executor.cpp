// Thread pool, manual executor and the thread-local "current" pointers of corpc/core.
#include "corpc/core/call_context.hpp"
#include "corpc/core/executor.hpp"

namespace corpc {

namespace {
thread_local Executor* tls_executor = nullptr;
thread_local CallContext tls_call_context{};
}  // namespace

Executor* current_executor() noexcept { return tls_executor; }
CallContext& current_call_context() noexcept { return tls_call_context; }

ExecutorScope::ExecutorScope(Executor* e) noexcept : previous_(tls_executor) { tls_executor = e; }
ExecutorScope::~ExecutorScope() { tls_executor = previous_; }

ThreadPool::ThreadPool(std::size_t threads, std::function<void()> on_start) : on_start_(std::move(on_start)) {
  if (threads == 0) threads = 1;
  threads_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

ThreadPool::~ThreadPool() { stop(); }

void ThreadPool::post(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void ThreadPool::stop() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable() && t.get_id() != std::this_thread::get_id()) t.join();
    else if (t.joinable()) t.detach();
  }
  threads_.clear();
}

void ThreadPool::run() {
  ExecutorScope scope(this);
  if (on_start_) on_start_();
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
    // A job must not leak its ambient context into the next one on this thread.
    tls_call_context = CallContext{};
  }
}

void BoundedExecutor::post(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(job));
    if (running_ == width_) return;
    ++running_;
  }
  underlying_.post([this] { run_one(); });
}

void BoundedExecutor::run_one() {
  std::function<void()> job;
  {
    std::lock_guard lock(mutex_);
    job = std::move(queue_.front());
    queue_.pop_front();
  }
  {
    ExecutorScope scope(this);  // continuations the job registers come back through this executor
    job();
  }
  {
    std::lock_guard lock(mutex_);
    if (queue_.empty()) {
      --running_;
      return;
    }
  }
  underlying_.post([this] { run_one(); });
}

void ManualExecutor::post(std::function<void()> job) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void ManualExecutor::notify() {
  { std::lock_guard lock(mutex_); }
  cv_.notify_one();
}

void ManualExecutor::run_until(const std::function<bool()>& done) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return !queue_.empty() || done(); });
      if (queue_.empty()) return;  // done, and nothing left that could still touch the caller's frame
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    job();
  }
}

}  // namespace corpc
