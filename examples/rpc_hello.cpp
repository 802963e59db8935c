// A first corpc program: three local worker processes calling each other.
//
//   build/examples/rpc_hello
//
// Started alone, it starts all three ranks on this machine. Under a launcher (RANK, WORLD_SIZE=3, MASTER_ADDR,
// MASTER_PORT set, as torchrun, corpcrun or Slurm do) each process runs its one rank.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstdlib>

#include "corpc/corpc.hpp"
#include "corpc/rref/rref.hpp"

using namespace corpc;

// Plain functions are callable remotely as they are: the call names them by pointer.
int add(int a, int b) { return a + b; }
at::Tensor scale(at::Tensor t, double k) { return t * k; }
std::string whoami() { return get_worker_info().name; }

// A coroutine holds no thread while it waits: here worker1 asks worker2 on the caller's behalf.
Task<std::string> relay(std::string to) {
  co_return "via " + get_worker_info().name + ": " + co_await rpc_async<&whoami>(to);
}

struct Counter {
  int value = 0;
  int add(int d) { return value += d; }
};

void run(int rank, int world) {
  init_rpc(rank == 0 ? "master" : "worker" + std::to_string(rank), rank, world);
  if (rank == 0) {
    std::printf("add on worker1: %d\n", rpc_sync<&add>("worker1", 2, 3));
    auto f = rpc_async<&scale>("worker2", at::arange(4, at::kFloat), 2.0);
    std::printf("scale on worker2: %s\n", at::str(f.wait(std::chrono::seconds(10))).c_str());
    std::printf(
        "%s\n",
        sync_wait([]() -> Task<std::string> { co_return co_await rpc_async<&relay>("worker1", "worker2"); }()).c_str());

    RRef<Counter> counter = remote<Counter>("worker2");  // an object that lives on worker2
    counter.rpc_sync<&Counter::add>(10);
    std::printf("counter on %s: %d\n", counter.owner_name().c_str(), counter.rpc_sync<&Counter::add>(5));

    try {
      rpc_sync<&add>("nobody", 1, 2);
    } catch (const UnknownWorkerError& e) {
      std::printf("as expected: %s\n", e.what());
    }
  }
  shutdown();  // graceful: waits until every worker is done
}

int main() {
  try {
    // Three local processes, each running this program again up to here; under a launcher (torchrun, corpcrun: RANK
    // and WORLD_SIZE=3 set) just this process's rank.
    launch_processes(3, [](int rank) { run(rank, 3); });
  } catch (const std::exception& e) {  // a dead peer, a timeout: one line and a non-zero status, not std::terminate
    std::fprintf(stderr, "rpc_hello: %s\n", e.what());
    return 1;
  }
  return 0;
}
