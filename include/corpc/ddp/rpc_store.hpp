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

#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace corpc::ddp {

class RpcStore : public c10d::Store {
 public:
  explicit RpcStore(int server_rank = 0, std::chrono::milliseconds timeout = kDefaultTimeout);

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  int server_;
};

}  // namespace corpc::ddp
