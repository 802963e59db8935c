// Whether a CUDA device is usable, asked in a forked child that exits at once. Asking the CUDA runtime for its
// devices initializes the driver, and a process forked from one that did cannot use CUDA at all (its cuInit fails
// with "initialization error"): the ranks of the GPU cases are forks of the test process (launch_processes), so the
// test process never touches CUDA itself; each rank starts it for its own.
#pragma once

#include <ATen/Context.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "../src/memory/cuda_transfer.hpp"

namespace corpc::test {

// `with_torch_kernels`: libtorch must have CUDA kernels too (a CUDA build of libtorch), not only corpc's copies.
inline bool cuda_usable_in_child(bool with_torch_kernels) {
  const pid_t pid = ::fork();
  if (pid < 0) return false;
  if (pid == 0) {
    bool ok = false;
    try {
      ok = detail::cuda::device_count() > 0 && (!with_torch_kernels || at::hasCUDA());
    } catch (...) {}
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

}  // namespace corpc::test
