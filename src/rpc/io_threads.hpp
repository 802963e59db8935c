// The runtime's I/O threads: each runs one io_context that owns a share of the connections (connection k, in order of
// creation, goes to thread k % n; thread 0 also runs the acceptor and the same-host listener) and is the executor
// of the coroutines that suspend there. A thread here must never block (NonBlockingThreadScope).
#pragma once

#include <asio.hpp>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

#include "corpc/core/executor.hpp"

namespace corpc::detail {

class IoThreads {
 public:
  // Makes `n` (at least 1) io_contexts; start() runs them. Before start(), handlers may already be bound to them.
  explicit IoThreads(int n);
  ~IoThreads();  // stops and joins, if stop() has not
  IoThreads(const IoThreads&) = delete;
  IoThreads& operator=(const IoThreads&) = delete;

  void start();
  void stop();  // lets every thread finish what it is running, then joins them

  asio::io_context& main() noexcept { return threads_[0]->io; }
  asio::io_context& pick() noexcept { return threads_[next_.fetch_add(1) % threads_.size()]->io; }
  bool running_here() const noexcept;  // the calling thread is one of them

 private:
  struct Thread {
    asio::io_context io;
    asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
    std::thread thread;
    std::unique_ptr<Executor> executor;  // posts to `io`; current on the thread
  };
  std::vector<std::unique_ptr<Thread>> threads_;
  std::atomic<std::size_t> next_{0};
};

}  // namespace corpc::detail
