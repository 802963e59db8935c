// The runtime's I/O threads (see io_threads.hpp).
#include "rpc/io_threads.hpp"

#include <string>

#include "corpc/core/detail/blocking.hpp"

#include "core/thread_name.hpp"
#include "core/trace_recorder.hpp"

namespace corpc::detail {

namespace {

// An I/O thread as an executor: coroutines suspended there come back to it.
class IoExecutor final : public Executor {
 public:
  explicit IoExecutor(asio::io_context& io) : io_(io) {}
  void enqueue(WorkItem* item) noexcept override {
    asio::post(io_, [item] { item->run(item); });
  }
  bool running_here() const noexcept override { return io_.get_executor().running_in_this_thread(); }

 private:
  asio::io_context& io_;
};

}  // namespace

IoThreads::IoThreads(int n) {
  for (int i = 0; i < std::max(1, n); ++i) threads_.push_back(std::make_unique<Thread>());
}

IoThreads::~IoThreads() { stop(); }

void IoThreads::start() {
  for (std::size_t i = 0; i < threads_.size(); ++i) {
    auto& t = threads_[i];
    t->executor = std::make_unique<IoExecutor>(t->io);
    t->thread = std::thread([t = t.get(), i] {
      name_this_thread("corpc-io-" + std::to_string(i));
      trace::detail::label_thread("io " + std::to_string(i));
      ExecutorScope scope(t->executor.get());
      NonBlockingThreadScope no_blocking;  // a blocking wait here would stop the thread that must deliver its value
      t->io.run();
    });
  }
}

void IoThreads::stop() {
  for (auto& t : threads_) {
    t->work.reset();
    t->io.stop();
  }
  for (auto& t : threads_)
    if (t->thread.joinable()) t->thread.join();
}

bool IoThreads::running_here() const noexcept {
  for (auto& t : threads_)
    if (t->thread.get_id() == std::this_thread::get_id()) return true;
  return false;
}

}  // namespace corpc::detail
