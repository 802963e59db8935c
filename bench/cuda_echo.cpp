// cuda_echo — CUDA tensors echoed between two processes that share one GPU, through corpc with device maps
// (the master's cuda:N -> worker1's cuda:N; worker1 replies through the inverse). The reference beside it is
// bench/pytorch_cuda_rpc.py (torch.distributed.rpc, TensorPipe, set_device_map): same sizes, same statistic;
// scripts/gpu_check.sh runs the two alternately.
//
//   cuda_echo [--sizes-mib 1,16,64] [--iters 20] [--warmup 3] [--device 0] [--label corpc]
//
// corpc picks its data path itself: CUDA IPC between two workers on one host when both can, device memory staged
// through pinned host memory otherwise; CORPC_CUDA_IPC=0 in the environment forces the staged path (gpu_check.sh runs
// both, the second with --label corpc-staged).
//
// One round trip: rpc_sync of echo(t), t a float32 tensor of that many MiB on the device, then a synchronize of the
// device, so that no copy of either direction is still running when the clock is read (PyTorch's side does the same).
// Per size: the median and the minimum of --iters round trips after --warmup untimed ones; the first reply is
// compared with what was sent, element for element. Output: a readable line per size and a line
// "RESULT <label> <MiB> <median ms> <min ms>" for drivers.
//
// Needs a CUDA device and a CUDA build of libtorch (the tensors are made and compared by ATen's CUDA kernels). Without
// either it says which is missing and exits with status 2. Whether they are there is asked in a forked child:
// querying the CUDA driver initializes it, and the ranks, forked from this process, could then not use CUDA at all.
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "corpc/corpc.hpp"

#include "../src/memory/cuda_transfer.hpp"
#include "bench_util.hpp"

using namespace corpc;
using Clock = std::chrono::steady_clock;

namespace {

at::Tensor echo(at::Tensor t) { return t; }

// What the child found, as its exit status.
enum Probe { kUsable = 0, kNoDevice = 1, kNoCudaLibtorch = 2, kProbeFailed = 3 };

Probe probe_in_child(int device) {
  const pid_t pid = ::fork();
  if (pid < 0) return kProbeFailed;
  if (pid == 0) {
    int code = kUsable;
    try {
      if (corpc::detail::cuda::device_count() <= device) code = kNoDevice;
      else if (!at::hasCUDA()) code = kNoCudaLibtorch;
    } catch (...) {
      code = kProbeFailed;
    }
    ::_exit(code);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (!WIFEXITED(status) || WEXITSTATUS(status) > kProbeFailed) return kProbeFailed;  // killed, or exited elsewhere
  return static_cast<Probe>(WEXITSTATUS(status));
}

void synchronize(int device) { at::detail::getCUDAHooks().deviceSynchronize(static_cast<c10::DeviceIndex>(device)); }

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  bench::Flags flags(argc, argv);
  if (flags.has("help")) {
    std::puts("cuda_echo [--sizes-mib 1,16,64] [--iters 20] [--warmup 3] [--device 0] [--label corpc]");
    return 0;
  }
  const std::vector<long> sizes = flags.get_list("sizes-mib", "1,16,64");
  const long iters = std::max(1L, flags.get_int("iters", 20));
  const long warmup = std::max(0L, flags.get_int("warmup", 3));
  const int index = static_cast<int>(flags.get_int("device", 0));
  const std::string label = flags.get("label", "corpc");
  const char* ipc = std::getenv("CORPC_CUDA_IPC");

  switch (probe_in_child(index)) {
    case kUsable: break;
    case kNoDevice:
      std::fprintf(stderr, "cuda_echo: no CUDA device cuda:%d here (%s): nothing to measure\n", index,
                   corpc::detail::cuda::built_with_cuda() ? "the CUDA runtime reports fewer devices"
                                                          : "this corpc was built without its CUDA data path");
      return 2;
    case kNoCudaLibtorch:
      std::fprintf(stderr,
                   "cuda_echo: this libtorch is a CPU build (no CUDA kernels): build against a CUDA libtorch "
                   "(-Dlibtorch_dir=<site-packages>/torch of PyTorch's CUDA wheel)\n");
      return 2;
    case kProbeFailed: std::fprintf(stderr, "cuda_echo: could not ask the CUDA runtime for its devices\n"); return 2;
  }

  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  std::printf(
      "# cuda_echo: float32 tensors on %s echoed master -> worker1 -> master (two processes, one GPU), device "
      "maps %s -> %s both ways; median and min of %ld round trips after %ld warm-up, each ended by a device "
      "synchronize; CORPC_CUDA_IPC=%s\n",
      device.str().c_str(), device.str().c_str(), device.str().c_str(), iters, warmup, ipc ? ipc : "(unset)");
  std::printf("%8s %12s %12s %10s\n", "MiB", "median ms", "min ms", "GB/s");
  std::fflush(stdout);

  RpcOptions options;
  options.init_timeout = std::chrono::seconds(60);
  options.rpc_timeout = std::chrono::seconds(120);
  LaunchOptions launch;
  launch.start = StartMethod::fork;  // the ranks share the parsed options; this process has started no thread
  launch.timeout = std::chrono::minutes(15);
  try {
    launch_processes(
        2,
        [&](int rank) {
          RpcOptions o = options;
          if (rank == 0) o.set_device_map("worker1", {{device, device}});  // worker1 uses the inverse for its replies
          init_rpc(rank == 0 ? "master" : "worker1", rank, 2, o);
          if (rank == 0) {
            for (long mib : sizes) {
              const std::int64_t n = mib * (std::int64_t{1} << 20) / 4;
              const at::Tensor x = at::rand({n}, at::TensorOptions().dtype(at::kFloat).device(device));
              at::Tensor back = rpc_sync<&echo>("worker1", x);
              if (back.device() != device || !at::equal(back, x))
                throw std::runtime_error("the echo of " + std::to_string(mib) + " MiB came back " +
                                         (back.device() != device ? "on " + back.device().str() : "with other values"));
              for (long i = 0; i < warmup; ++i) back = rpc_sync<&echo>("worker1", x);
              synchronize(index);
              std::vector<double> times;
              for (long i = 0; i < iters; ++i) {
                const auto t0 = Clock::now();
                back = rpc_sync<&echo>("worker1", x);
                synchronize(index);
                times.push_back(ms_since(t0));
              }
              std::sort(times.begin(), times.end());
              const double median = times.size() % 2 ? times[times.size() / 2]
                                                     : (times[times.size() / 2 - 1] + times[times.size() / 2]) / 2;
              const double gbps = 2.0 * static_cast<double>(n) * 4 / (median * 1e6);  // both directions
              std::printf("%8ld %12.3f %12.3f %10.2f\n", mib, median, times.front(), gbps);
              std::printf("RESULT %s %ld %.4f %.4f\n", label.c_str(), mib, median, times.front());
              std::fflush(stdout);
            }
          }
          shutdown();
        },
        launch);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_echo: %s\n", e.what());
    return 1;
  }
  return 0;
}
