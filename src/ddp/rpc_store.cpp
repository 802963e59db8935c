// RpcStore (see corpc/ddp/rpc_store.hpp): the table on the server worker and one RPC per store operation.
#include "corpc/ddp/rpc_store.hpp"

#include <algorithm>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "corpc/core/task.hpp"
#include "corpc/rpc/call.hpp"
#include "corpc/rpc/errors.hpp"

namespace corpc::ddp::store_detail {

using Bytes = std::vector<uint8_t>;

// The key-value map of the server worker: a runtime extension, so it lives exactly as long as that worker's RPC.
class Table {
 public:
  explicit Table(Runtime&) {}
  ~Table() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    expiry_.notify_all();
    if (reaper_.joinable()) reaper_.join();
  }

  void set(const std::string& key, Bytes value) {
    std::vector<Promise<bool>> woken;
    {
      std::lock_guard lock(mutex_);
      kv_[key] = std::move(value);
      wake_locked(woken);
    }
    for (auto& p : woken) p.set_value(true);  // outside the lock: a waiter may resume inline and call back in
  }

  // c10d's contract: set `desired` if the key holds `expected` (or is missing and `expected` is empty); returns the
  // value the key holds afterwards (or `expected` when the key is missing and `expected` is not empty).
  Bytes compare_set(const std::string& key, const Bytes& expected, Bytes desired) {
    std::vector<Promise<bool>> woken;
    Bytes result;
    {
      std::lock_guard lock(mutex_);
      auto it = kv_.find(key);
      if (it == kv_.end()) {
        if (!expected.empty()) return expected;
        result = kv_[key] = std::move(desired);
        wake_locked(woken);
      } else if (it->second == expected) {
        result = it->second = std::move(desired);
      } else {
        return it->second;
      }
    }
    for (auto& p : woken) p.set_value(true);
    return result;
  }

  int64_t add(const std::string& key, int64_t delta) {
    std::vector<Promise<bool>> woken;
    int64_t value = delta;
    {
      std::lock_guard lock(mutex_);
      auto it = kv_.find(key);
      if (it != kv_.end()) value += std::stoll(std::string(it->second.begin(), it->second.end()));
      const auto text = std::to_string(value);
      kv_[key] = Bytes(text.begin(), text.end());
      if (it == kv_.end()) wake_locked(woken);
    }
    for (auto& p : woken) p.set_value(true);
    return value;
  }

  Bytes get(const std::string& key) {
    std::lock_guard lock(mutex_);
    auto it = kv_.find(key);
    if (it == kv_.end()) throw RpcError("RpcStore: key '" + key + "' was deleted while being waited for");
    return it->second;
  }

  bool erase(const std::string& key) {
    std::lock_guard lock(mutex_);
    return kv_.erase(key) > 0;
  }

  bool check(const std::vector<std::string>& keys) {
    std::lock_guard lock(mutex_);
    return present_locked(keys);
  }

  int64_t size() {
    std::lock_guard lock(mutex_);
    return static_cast<int64_t>(kv_.size());
  }

  // Completes with true once every key is present, or with false at the deadline. Waiters must expire here rather
  // than only on the caller: an unanswered request would hold up graceful shutdown forever.
  Future<bool> when_present(std::vector<std::string> keys, std::chrono::milliseconds timeout) {
    std::lock_guard lock(mutex_);
    if (present_locked(keys)) return make_ready_future(true);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    waiters_.push_back(Waiter{std::move(keys), deadline, Promise<bool>()});
    auto f = waiters_.back().done.get_future();
    if (!reaper_.joinable()) reaper_ = std::thread([this] { expire_waiters(); });
    expiry_.notify_all();
    return f;
  }

 private:
  struct Waiter {
    std::vector<std::string> keys;
    std::chrono::steady_clock::time_point deadline;
    Promise<bool> done;
  };

  bool present_locked(const std::vector<std::string>& keys) const {
    for (const auto& k : keys) {
      if (kv_.count(k) == 0) return false;
    }
    return true;
  }

  void wake_locked(std::vector<Promise<bool>>& woken) {
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (present_locked(it->keys)) {
        woken.push_back(std::move(it->done));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void expire_waiters() {
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      auto next = std::chrono::steady_clock::time_point::max();
      std::vector<Promise<bool>> expired;
      const auto now = std::chrono::steady_clock::now();
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        if (it->deadline <= now) {
          expired.push_back(std::move(it->done));
          it = waiters_.erase(it);
        } else {
          next = std::min(next, it->deadline);
          ++it;
        }
      }
      if (!expired.empty()) {
        lock.unlock();
        for (auto& p : expired) p.set_value(false);
        lock.lock();
        continue;
      }
      if (next == std::chrono::steady_clock::time_point::max()) {
        expiry_.wait(lock);
      } else {
        expiry_.wait_until(lock, next);
      }
    }
  }

  std::mutex mutex_;
  std::unordered_map<std::string, Bytes> kv_;
  std::list<Waiter> waiters_;
  bool stopping_ = false;
  std::condition_variable expiry_;
  std::thread reaper_;
};

std::shared_ptr<Table> table() { return Runtime::get().extension<Table>(); }

// The operations, as the server runs them.
void store_set(std::string key, Bytes value) { table()->set(key, std::move(value)); }
Bytes store_compare_set(std::string key, Bytes expected, Bytes desired) {
  return table()->compare_set(key, expected, std::move(desired));
}
int64_t store_add(std::string key, int64_t delta) { return table()->add(key, delta); }
bool store_delete(std::string key) { return table()->erase(key); }
bool store_check(std::vector<std::string> keys) { return table()->check(keys); }
int64_t store_num_keys() { return table()->size(); }
// false: the keys did not all appear within timeout_ms.
Future<bool> store_wait(std::vector<std::string> keys, int64_t timeout_ms) {
  return table()->when_present(std::move(keys), std::chrono::milliseconds(timeout_ms));
}
// nullopt: the key did not appear within timeout_ms.
Task<std::optional<Bytes>> store_get(std::string key, int64_t timeout_ms) {
  auto t = table();
  std::vector<std::string> keys(1, key);  // (not a braced list inside co_await: g++ 12 rejects it)
  if (!co_await t->when_present(std::move(keys), std::chrono::milliseconds(timeout_ms))) co_return std::nullopt;
  co_return t->get(key);
}

}  // namespace corpc::ddp::store_detail

namespace sd = corpc::ddp::store_detail;
CORPC_IO_THREAD_FUNCTION(&sd::store_set);
CORPC_IO_THREAD_FUNCTION(&sd::store_compare_set);
CORPC_IO_THREAD_FUNCTION(&sd::store_add);
CORPC_IO_THREAD_FUNCTION(&sd::store_delete);
CORPC_IO_THREAD_FUNCTION(&sd::store_check);
CORPC_IO_THREAD_FUNCTION(&sd::store_num_keys);
CORPC_IO_THREAD_FUNCTION(&sd::store_wait);
CORPC_IO_THREAD_FUNCTION(&sd::store_get);

namespace corpc::ddp {

RpcStore::RpcStore(int server_rank, std::chrono::milliseconds timeout) : c10d::Store(timeout), server_(server_rank) {}

void RpcStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  rpc_sync<&sd::store_set>(server_, with_timeout(timeout_), key, value);
}

std::vector<uint8_t> RpcStore::compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                          const std::vector<uint8_t>& desired) {
  return rpc_sync<&sd::store_compare_set>(server_, with_timeout(timeout_), key, expected, desired);
}

namespace {
// The server answers a wait at its deadline; the call's own deadline is later, so that the answer wins.
CallOptions wait_call(std::chrono::milliseconds timeout) { return with_timeout(timeout + std::chrono::seconds(10)); }

[[noreturn]] void wait_timed_out(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::string names;
  for (const auto& k : keys) names += (names.empty() ? "'" : ", '") + k + "'";
  throw TimeoutError("RpcStore: keys " + names + " not set within " + std::to_string(timeout.count()) + " ms");
}
}  // namespace

std::vector<uint8_t> RpcStore::get(const std::string& key) {
  auto value = rpc_sync<&sd::store_get>(server_, wait_call(timeout_), key, timeout_.count());
  if (!value) wait_timed_out({key}, timeout_);
  return std::move(*value);
}

int64_t RpcStore::add(const std::string& key, int64_t value) {
  return rpc_sync<&sd::store_add>(server_, with_timeout(timeout_), key, value);
}

bool RpcStore::deleteKey(const std::string& key) {
  return rpc_sync<&sd::store_delete>(server_, with_timeout(timeout_), key);
}

bool RpcStore::check(const std::vector<std::string>& keys) {
  return rpc_sync<&sd::store_check>(server_, with_timeout(timeout_), keys);
}

int64_t RpcStore::getNumKeys() { return rpc_sync<&sd::store_num_keys>(server_, with_timeout(timeout_)); }

c10::intrusive_ptr<c10d::Store> RpcStore::clone() {
  return c10::make_intrusive<RpcStore>(server_, std::chrono::duration_cast<std::chrono::milliseconds>(timeout_));
}

void RpcStore::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void RpcStore::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  if (!rpc_sync<&sd::store_wait>(server_, wait_call(timeout), keys, timeout.count())) wait_timed_out(keys, timeout);
}

}  // namespace corpc::ddp
