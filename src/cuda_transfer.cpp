// The CUDA data path (see cuda_transfer.hpp), on the CUDA runtime API. Built only when Meson finds the toolkit.
//
// Completion is observed with cudaLaunchHostFunc on the transfer stream, not by polling an event from the I/O
// thread's timer: the host function runs as soon as the copy is done (polling adds up to a tick of latency per message,
// or burns a core), and it only counts the part done and posts the rest to an I/O thread. CUDA forbids CUDA calls
// inside a host function, so nothing there frees device or pinned memory: what the copy kept alive is handed to a
// list that the next transfer (or the continuation, via release_finished) frees on an ordinary thread.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <array>
#include <map>
#include <mutex>
#include <string>

#include "corpc/core/errors.hpp"
#include "cuda_transfer.hpp"

namespace corpc::detail::cuda {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw RpcError(std::string("CUDA ") + what + ": " + cudaGetErrorString(e));
}

// Makes `device` current for the scope (the calling thread's device is the user's: restored afterwards).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// One transfer stream per device, created on first use. Non-blocking: it never waits for the legacy default stream
// implicitly, only for the producer's event.
constexpr int kMaxDevices = 128;
std::array<cudaStream_t, kMaxDevices> g_streams{};
std::mutex g_streams_mutex;

cudaStream_t transfer_stream(int device) {
  if (device < 0 || device >= kMaxDevices) throw UsageError("CUDA device index " + std::to_string(device));
  std::lock_guard lock(g_streams_mutex);
  if (!g_streams[device]) check(cudaStreamCreateWithFlags(&g_streams[device], cudaStreamNonBlocking), "cudaStreamCreate");
  return g_streams[device];
}

// The stream the tensor's producer queued its work on, as far as the runtime API can tell: PyTorch's default stream,
// the legacy default stream. Work on other streams must be synchronized by the caller before sending (README).
cudaStream_t producer_stream() { return cudaStreamLegacy; }

// Pinned host blocks, kept for reuse by exact size (a steady stream of same-sized tensors pins memory once).
class PinnedPool {
 public:
  void* acquire(std::size_t n) {
    {
      std::lock_guard lock(mutex_);
      if (auto it = free_.find(n); it != free_.end()) {
        void* p = it->second;
        free_.erase(it);
        cached_ -= n;
        return p;
      }
    }
    void* p = nullptr;
    check(cudaHostAlloc(&p, n, cudaHostAllocDefault), "cudaHostAlloc");
    return p;
  }
  void release(void* p, std::size_t n) noexcept {
    {
      std::lock_guard lock(mutex_);
      if (cached_ + n <= kMaxCached) {
        free_.emplace(n, p);
        cached_ += n;
        return;
      }
    }
    cudaFreeHost(p);
  }

 private:
  static constexpr std::size_t kMaxCached = std::size_t{256} << 20;
  std::mutex mutex_;
  std::multimap<std::size_t, void*> free_;
  std::size_t cached_ = 0;
};
PinnedPool& pinned_pool() {
  static auto* pool = new PinnedPool;  // never destroyed: blocks may be released during static destruction
  return *pool;
}

struct PinnedBlock {
  void* p;
  std::size_t n;
};
void release_pinned(void* ctx) {
  auto* b = static_cast<PinnedBlock*>(ctx);
  pinned_pool().release(b->p, b->n);
  delete b;
}

at::Tensor pinned_empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  std::int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const std::size_t n = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  const auto options = at::TensorOptions().dtype(dtype);
  if (n == 0) return at::empty_strided(sizes, strides, options);
  void* p = pinned_pool().acquire(n);
  c10::Storage storage(c10::Storage::use_byte_size_t(), n,
                       c10::DataPtr(p, new PinnedBlock{p, n}, &release_pinned, at::Device(at::kCPU)), nullptr,
                       /*resizable=*/false);
  at::Tensor t = at::empty({0}, options);
  t.set_(std::move(storage), 0, sizes, strides);
  return t;
}

// Tensors whose copies have finished, freed outside host functions.
std::mutex g_finished_mutex;
std::vector<at::Tensor> g_finished;

void release_finished() {
  std::vector<at::Tensor> dead;
  {
    std::lock_guard lock(g_finished_mutex);
    dead.swap(g_finished);
  }
}

struct CopyDone {
  std::shared_ptr<DeviceTransfer> transfer;
  std::vector<at::Tensor> keep;  // source and destination of the copy
};

void CUDART_CB on_copied(void* p) {
  std::unique_ptr<CopyDone> done(static_cast<CopyDone*>(p));
  {
    std::lock_guard lock(g_finished_mutex);
    for (auto& t : done->keep) g_finished.push_back(std::move(t));
  }
  done->transfer->part_done();
}

// Enqueues the completion of one part after what `stream` holds now.
void complete_after(cudaStream_t stream, const std::shared_ptr<DeviceTransfer>& transfer, std::vector<at::Tensor> keep) {
  transfer->add_part();
  auto* done = new CopyDone{transfer, std::move(keep)};
  if (cudaError_t e = cudaLaunchHostFunc(stream, &on_copied, done); e != cudaSuccess) {
    // The copy may still be running into or out of `keep`: wait for it before anything is released (error path).
    cudaStreamSynchronize(stream);
    done->transfer->part_done(std::make_exception_ptr(RpcError(std::string("CUDA cudaLaunchHostFunc: ") + cudaGetErrorString(e))));
    delete done;
  }
}

std::size_t bytes_of(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

}  // namespace

bool built_with_cuda() noexcept { return true; }

int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not sticky, but clear it for the user's next call
    return 0;
  }
  return n;
}

at::Tensor stage_to_host(const at::Tensor& t, const std::shared_ptr<DeviceTransfer>& transfer) {
  release_finished();
  const int device = t.device().index();
  DeviceScope scope(device);
  const cudaStream_t stream = transfer_stream(device);
  at::Tensor host = pinned_empty_strided(t.sizes(), t.strides(), t.scalar_type());
  const std::size_t n = bytes_of(t);
  if (n == 0) return host;
  // Ordered after the producer: the transfer stream waits for an event recorded on its stream now.
  cudaEvent_t produced;
  check(cudaEventCreateWithFlags(&produced, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t e = cudaEventRecord(produced, producer_stream());
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, produced, 0);
  cudaEventDestroy(produced);  // released once the wait has been satisfied
  check(e, "cudaEventRecord/cudaStreamWaitEvent");
  check(cudaMemcpyAsync(host.data_ptr(), t.data_ptr(), n, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync");
  complete_after(stream, transfer, {t, host});
  return host;
}

at::Tensor host_receive_buffer(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  if (device_count() == 0) return at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
  return pinned_empty_strided(sizes, strides, dtype);
}

void upload(std::vector<at::Tensor>& tensors, const std::vector<std::int8_t>& devices,
            const std::shared_ptr<DeviceTransfer>& transfer) {
  release_finished();
  for (std::size_t i = 0; i < tensors.size() && i < devices.size(); ++i) {
    const int device = devices[i];
    if (device < 0) continue;
    DeviceScope scope(device);
    const cudaStream_t stream = transfer_stream(device);
    const at::Tensor host = tensors[i];
    const std::size_t n = bytes_of(host);
    void* p = nullptr;
    if (n) check(cudaMallocAsync(&p, n, stream), "cudaMallocAsync");
    // Freed in stream order after the default stream's work (PyTorch's caching allocator is not reachable here).
    auto free_on_device = [device](void* q) {
      if (!q) return;
      int previous = 0;
      cudaGetDevice(&previous);
      cudaSetDevice(device);
      cudaFreeAsync(q, cudaStreamLegacy);
      cudaSetDevice(previous);
    };
    const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
    at::Tensor dev = at::from_blob(p, host.sizes(), host.strides(), free_on_device, host.options().device(target), target);
    if (n) {
      check(cudaMemcpyAsync(p, host.data_ptr(), n, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
      // Work the receiver then queues on the default stream is ordered after the copy even before delivery.
      cudaEvent_t copied;
      check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "cudaEventCreate");
      cudaError_t e = cudaEventRecord(copied, stream);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(cudaStreamLegacy, copied, 0);
      cudaEventDestroy(copied);
      check(e, "cudaEventRecord/cudaStreamWaitEvent");
      complete_after(stream, transfer, {host});
    }
    if (host.requires_grad()) dev.set_requires_grad(true);
    tensors[i] = std::move(dev);
  }
}

at::Tensor copy_to_device(const at::Tensor& host, int device) {
  const at::Tensor src = host.contiguous();
  DeviceScope scope(device);
  void* p = nullptr;
  if (bytes_of(src)) check(cudaMalloc(&p, bytes_of(src)), "cudaMalloc");
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  at::Tensor dev = at::from_blob(p, src.sizes(), src.strides(), [](void* q) { cudaFree(q); },
                                 src.options().device(target), target);
  if (p) check(cudaMemcpy(p, src.data_ptr(), bytes_of(src), cudaMemcpyHostToDevice), "cudaMemcpy");
  return dev;
}

at::Tensor copy_to_host(const at::Tensor& t) {
  DeviceScope scope(t.device().index());
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  at::Tensor host = at::empty_strided(t.sizes(), t.strides(), at::TensorOptions().dtype(t.scalar_type()));
  if (bytes_of(t)) check(cudaMemcpy(host.data_ptr(), t.data_ptr(), bytes_of(t), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return host;
}

}  // namespace corpc::detail::cuda
