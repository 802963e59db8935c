/// @file
/// A c10d::Store whose key-value map lives on one RPC worker, reached by corpc RPCs.
///
/// With it a program that called init_rpc gets its process group from the same rendezvous (one MASTER_PORT, one
/// set of connections): init_process_group() uses it, under a per-group prefix, whenever RPC is running.
///
/// ```cpp
///   corpc::init_rpc("trainer0", rank, world);
///   auto pg = corpc::ddp::init_process_group();   // keys on rank 0, behind c10d::PrefixStore("corpc/ddp/0/")
/// ```
///
/// The map is on `server_rank` (0 by default). Every operation is one RPC to it, run on its I/O thread (they are
/// short and never block). wait() and get() on a missing key are answered when the key appears: the server holds a
/// promise, not a thread. A wait that outlives the store's timeout fails with corpc::TimeoutError on the caller.
/// Values written by add() are decimal strings, as in c10d's TCPStore.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace corpc::ddp {

/// A c10d::Store over corpc RPC (see corpc/ddp/rpc_store.hpp). Every operation blocks the calling thread for one RPC
/// to `server_rank` (so UsageError on a corpc I/O thread) and throws that call's corpc errors: TimeoutError past
/// the store's timeout, ConnectionError if the server died, ShutdownError without a running runtime.
class RpcStore : public c10d::Store {
 public:
  /// A client of the map on `server_rank`; `timeout` bounds every operation and is the default for wait().
  explicit RpcStore(int server_rank = 0, std::chrono::milliseconds timeout = kDefaultTimeout);

  /// Sets `key` to `value`.
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  /// Sets `key` to `desired` if it holds `expected` (or is missing and `expected` is empty); returns the value it
  /// holds afterwards, or `expected` if it is missing (as c10d's TCPStore does).
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  /// The value of `key`, waiting (up to the timeout) until it is set.
  std::vector<uint8_t> get(const std::string& key) override;
  /// Adds `value` to the decimal counter at `key` (0 if missing); returns the new count.
  int64_t add(const std::string& key, int64_t value) override;
  /// Removes `key`; false if it was missing.
  bool deleteKey(const std::string& key) override;
  /// True if every key is set (does not wait).
  bool check(const std::vector<std::string>& keys) override;
  /// The number of keys in the map.
  int64_t getNumKeys() override;
  /// Waits until every key is set, up to the store's timeout.
  void wait(const std::vector<std::string>& keys) override;
  /// Waits until every key is set; TimeoutError after `timeout`.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;
  /// Another client of the same map, with this one's server and timeout (c10d asks for one per thread that uses a
  /// store). Declared without `override`: c10d::Store has it from libtorch 2.14, and not on 2.6 and earlier.
  c10::intrusive_ptr<c10d::Store> clone();

 private:
  int server_;
};

}  // namespace corpc::ddp
