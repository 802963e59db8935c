// What the training-system examples share: one intra-op thread per process, and running either as local processes
// or as one rank of a launcher's world.
#pragma once

#include <ATen/Parallel.h>
#include <corpc/corpc.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>

#include "../../bench/bench_util.hpp"

namespace systems {

// One intra-op thread everywhere (OpenMP's count is per thread, so worker threads set it too), and OpenBLAS's own
// pool capped as well: several processes share few cores, and idle pools would spin.
inline corpc::RpcOptions single_threaded(corpc::RpcOptions options = {}) {
  corpc::bench::set_blas_threads(1);
  at::set_num_threads(1);
  options.worker_thread_init = [] { at::set_num_threads(1); };
  return options;
}

// Runs body(rank) on `world` local processes, or this process's rank only when a launcher (torchrun --no_python,
// corpcrun, Slurm) set RANK and WORLD_SIZE (which must equal `world`): launch_processes decides. A rank that throws
// leaves with shutdown_after_error, so the others fail too. Returns the process exit status, with one line on stderr
// on failure.
inline int run_program(const char* program, int world, const std::function<void(int rank)>& body) {
  try {
    corpc::launch_processes(world, body);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return 1;
  }
  return 0;
}

}  // namespace systems
