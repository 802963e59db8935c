// The smallest corpc program, built out of tree from an installed corpc (pkg-config, CMake) or as a Meson subproject
// by tests/consumer/run.sh. Under a launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process is one
// rank; started alone it runs both ranks as local processes.
#include <corpc/corpc.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

int add(int a, int b) { return a + b; }

void run(int rank, int world) {
  corpc::init_rpc("worker" + std::to_string(rank), rank, world);
  if (rank == 0) {
    const int sum = corpc::rpc_sync<&add>("worker1", 2, 3);
    std::printf("consumer: add on worker1 = %d\n", sum);
    if (sum != 5) throw std::runtime_error("wrong sum");
  }
  corpc::shutdown();
}

int main() {
  try {
    if (std::getenv("RANK") != nullptr) {
      run(-1, -1);
    } else {
      corpc::launch_processes(2, [](int rank) { run(rank, 2); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
  return 0;
}
