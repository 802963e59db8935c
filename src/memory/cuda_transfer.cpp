// The CUDA data path (see cuda_transfer.hpp): staging through pinned host memory, and CUDA IPC between workers on one
// host (its protocol and bookkeeping are in cuda_ipc.hpp; its CUDA side is the last part of this file). Built only
// when Meson finds the toolkit; CORPC_TORCH_CUDA when libtorch is a CUDA build, whose c10::cuda supplies the
// producer's stream, the device allocator and, for IPC, the allocation a tensor was carved from.
//
// Completion is observed with cudaLaunchHostFunc on the transfer stream, not by polling an event from the I/O
// thread's timer: the host function runs as soon as the copy is done (polling adds up to a tick of latency per message,
// or burns a core), and it only counts the part done and posts the rest to an I/O thread. CUDA forbids CUDA calls
// inside a host function, so nothing there frees device or pinned memory (or closes an IPC mapping): what the copy
// kept alive is handed to a list that the next transfer (or the continuation, via release_finished) frees on an
// ordinary thread.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#if CORPC_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "corpc/wire/errors.hpp"

#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"

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
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// One transfer stream per device, created on first use. Non-blocking: it never waits for the legacy default stream
// implicitly, only for the producer's event. corpc's own in both builds, rather than one from c10's pool with a CUDA
// libtorch: the pool's streams are handed out round robin to everyone who asks (c10d, user code), so a transfer could
// queue behind unrelated kernels; c10 sees ours through getStreamFromExternal where it must (recordStream).
constexpr int kMaxDevices = 128;
std::array<cudaStream_t, kMaxDevices> g_streams{};
std::mutex g_streams_mutex;

cudaStream_t transfer_stream(int device) {
  if (device < 0 || device >= kMaxDevices) throw UsageError("CUDA device index " + std::to_string(device));
  std::lock_guard lock(g_streams_mutex);
  if (!g_streams[device])
    check(cudaStreamCreateWithFlags(&g_streams[device], cudaStreamNonBlocking), "cudaStreamCreate");
  return g_streams[device];
}

#if CORPC_TORCH_CUDA
// The current stream of the tensor's device on the sending thread: where PyTorch code queues the kernels that produce
// a tensor (the default stream unless the producer made another one current), so the copy waits for exactly them.
cudaStream_t producer_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

// From libtorch's caching allocator, as any tensor of the consumer's (it can be resized, shared, freed into the pool).
// The allocation belongs to the current stream of `device` on this, the delivering thread (an I/O thread, whose current
// stream is the default stream: corpc never sets another there); the transfer stream writes it, so the allocator is told
// not to reuse the block before that write is done, whenever the consumer frees it.
at::Tensor device_empty(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype, int device,
                        cudaStream_t written_on) {
  const auto index = static_cast<c10::DeviceIndex>(device);
  at::Tensor dev =
      at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, index)));
  if (dev.storage().data_ptr().get())
    c10::cuda::CUDACachingAllocator::recordStream(dev.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(written_on, index));
  return dev;
}

// The consumer is whoever runs on the current stream of `device` of the delivering thread (an I/O thread): the
// default stream, which is also what corpc's worker-pool threads and continuations have current, since corpc never
// sets a stream on its threads. Handlers that make another stream current must order it after the default stream
// themselves, as for any tensor made on another stream.
void consumer_waits(int device, cudaStream_t stream) {
  cudaEvent_t copied;
  check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t e = cudaEventRecord(copied, stream);
  if (e == cudaSuccess)
    e = cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream(), copied, 0);
  cudaEventDestroy(copied);
  check(e, "cudaEventRecord/cudaStreamWaitEvent");
}
#else
// The stream the tensor's producer queued its work on, as far as the runtime API can tell: PyTorch's default stream,
// the legacy default stream. Work on other streams must be synchronized by the caller before sending (docs/cuda.md).
cudaStream_t producer_stream(int) { return cudaStreamLegacy; }

// Allocated in stream order on the transfer stream, freed in stream order after the default stream's work (PyTorch's
// caching allocator is not reachable here).
at::Tensor device_empty(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype, int device,
                        cudaStream_t written_on) {
  std::int64_t numel = 1;
  for (auto s : sizes) numel *= s;
  const std::size_t n = static_cast<std::size_t>(numel) * c10::elementSize(dtype);
  void* p = nullptr;
  if (n) check(cudaMallocAsync(&p, n, written_on), "cudaMallocAsync");
  auto free_on_device = [device](void* q) {
    if (!q) return;
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    cudaFreeAsync(q, cudaStreamLegacy);
    cudaSetDevice(previous);
  };
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  return at::from_blob(p, sizes, strides, free_on_device, at::TensorOptions().dtype(dtype).device(target), target);
}

// Work the receiver then queues on the default stream is ordered after the copy even before delivery.
void consumer_waits(int, cudaStream_t stream) {
  cudaEvent_t copied;
  check(cudaEventCreateWithFlags(&copied, cudaEventDisableTiming), "cudaEventCreate");
  cudaError_t e = cudaEventRecord(copied, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(cudaStreamLegacy, copied, 0);
  cudaEventDestroy(copied);
  check(e, "cudaEventRecord/cudaStreamWaitEvent");
}
#endif

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

// What finished copies kept alive, freed outside host functions.
std::mutex g_finished_mutex;
std::vector<at::Tensor> g_finished;
std::vector<std::shared_ptr<void>> g_finished_too;

struct CopyDone {
  std::shared_ptr<DeviceTransfer> transfer;
  std::vector<at::Tensor> keep;  // source and destination of the copy
  std::vector<std::shared_ptr<void>> keep_too;
};

void CUDART_CB on_copied(void* p) {
  std::unique_ptr<CopyDone> done(static_cast<CopyDone*>(p));
  {
    std::lock_guard lock(g_finished_mutex);
    for (auto& t : done->keep) g_finished.push_back(std::move(t));
    for (auto& k : done->keep_too) g_finished_too.push_back(std::move(k));
  }
  done->transfer->part_done();
}

std::size_t bytes_of(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()) * t.element_size(); }

// Frees what finished copies kept alive (an ordinary thread).
void release_finished() {
  std::vector<at::Tensor> dead;
  std::vector<std::shared_ptr<void>> dead_too;
  {
    std::lock_guard lock(g_finished_mutex);
    dead.swap(g_finished);
    dead_too.swap(g_finished_too);
  }
}

// Enqueues the completion of one part after what `stream` holds now; `keep` and `keep_too` (what the copy reads or
// writes) live until then.
void complete_after(cudaStream_t stream, const std::shared_ptr<DeviceTransfer>& transfer, std::vector<at::Tensor> keep,
                    std::vector<std::shared_ptr<void>> keep_too = {}) {
  transfer->add_part();
  auto* done = new CopyDone{transfer, std::move(keep), std::move(keep_too)};
  if (cudaError_t e = cudaLaunchHostFunc(stream, &on_copied, done); e != cudaSuccess) {
    // The copy may still be running into or out of `keep`: wait for it before anything is released (error path).
    cudaStreamSynchronize(stream);
    done->transfer->part_done(
        std::make_exception_ptr(RpcError(std::string("CUDA cudaLaunchHostFunc: ") + cudaGetErrorString(e))));
    delete done;
  }
}

#if CORPC_TORCH_CUDA
// ---- CUDA IPC: lending and borrowing (the protocol is in cuda_ipc.hpp) ----------------------------------------------
// Only a CUDA build of libtorch can lend: CUDA IPC exports whole allocations (cudaMalloc's), and only the caching
// allocator knows which allocation a tensor's storage was carved from.

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes && sizeof(cudaIpcEventHandle_t) == kCudaIpcHandleBytes);

std::string cuda_error(const char* what, cudaError_t e) {
  cudaGetLastError();  // IPC failures are not sticky: clear them for the user's next call
  return std::string("CUDA ") + what + ": " + cudaGetErrorString(e);
}

// Interprocess events, per device, reused once their loan is returned (the borrower has waited on them by then):
// creating one and exporting its handle costs more than recording it. Kept for the process; there are as many as
// loans were ever out at once.
struct IpcEvent {
  cudaEvent_t event = nullptr;
  cudaIpcEventHandle_t handle{};
  int device = -1;
};
class IpcEvents {
 public:
  IpcEvent acquire(int device) {  // the device is current
    {
      std::lock_guard lock(mutex_);
      auto& free = free_[device];
      if (!free.empty()) {
        IpcEvent e = free.back();
        free.pop_back();
        return e;
      }
    }
    IpcEvent e;
    e.device = device;
    if (cudaError_t r = cudaEventCreateWithFlags(&e.event, cudaEventDisableTiming | cudaEventInterprocess);
        r != cudaSuccess)
      throw RpcError(cuda_error("cudaEventCreateWithFlags(cudaEventInterprocess)", r));
    if (cudaError_t r = cudaIpcGetEventHandle(&e.handle, e.event); r != cudaSuccess) {
      cudaEventDestroy(e.event);
      throw RpcError(cuda_error("cudaIpcGetEventHandle", r));
    }
    return e;
  }
  void release(const IpcEvent& e) {
    std::lock_guard lock(mutex_);
    free_[e.device].push_back(e);
  }

 private:
  std::mutex mutex_;
  std::map<int, std::vector<IpcEvent>> free_;
};
IpcEvents& ipc_events() {
  static auto* events = new IpcEvents;  // never destroyed: loans may be returned during static destruction
  return *events;
}

// What the lender keeps until the borrower is done: the tensor (its storage is the memory lent) and the event.
struct Loan {
  Loan(at::Tensor t, IpcEvent e) : tensor(std::move(t)), event(e) {}
  Loan(const Loan&) = delete;
  Loan& operator=(const Loan&) = delete;
  ~Loan() { ipc_events().release(event); }
  at::Tensor tensor;
  IpcEvent event;
};

// The lenders' allocations mapped here, one mapping per handle in the process (CUDA refuses to open a handle a
// second time in one process, and two connections to one peer may both be lent from one allocation). Each
// shared_ptr handed out counts as a user; the last one closes the mapping, under the lock, so that a handle is never
// reopened before its old mapping is closed. Users: the links' caches, and the copies in flight.
struct Mapping {
  void* base = nullptr;
  int device = -1;
  std::size_t users = 0;
};
std::mutex g_mappings_mutex;
std::map<CudaIpcHandle, Mapping> g_mappings;

void drop_mapping(const CudaIpcHandle& key) {
  std::lock_guard lock(g_mappings_mutex);
  auto it = g_mappings.find(key);
  if (it == g_mappings.end() || --it->second.users > 0) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(it->second.device);
  cudaIpcCloseMemHandle(it->second.base);
  cudaSetDevice(previous);
  cudaGetLastError();
  g_mappings.erase(it);
}

// Opens (or shares) the mapping of `key` on `device`, which is current.
std::shared_ptr<void> open_mapping(const CudaIpcHandle& key, int device) {
  std::lock_guard lock(g_mappings_mutex);
  auto it = g_mappings.find(key);
  if (it == g_mappings.end()) {
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, key.data(), sizeof handle);
    void* base = nullptr;
    // Lazy peer access: the lender's device may be another GPU of this host than the one we copy on.
    if (cudaError_t e = cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess); e != cudaSuccess)
      throw RpcError(cuda_error("cudaIpcOpenMemHandle", e));
    it = g_mappings.emplace(key, Mapping{base, device, 0}).first;
  }
  ++it->second.users;
  return std::shared_ptr<void>(it->second.base, [key](void*) { drop_mapping(key); });
}

// Starts copying the tensor of entry `m`, lent by the peer of `link`, from its memory to m.device, a part of
// `transfer`, and puts the device tensor in `slot` (its placeholder, whose requires_grad it takes). Throws RpcError
// if it cannot be mapped, and tells `link` (its peer stops lending).
void borrow(at::Tensor& slot, const TensorMeta& m, CudaIpcLink& link, const std::shared_ptr<DeviceTransfer>& transfer) {
  const int device = m.device;
  const CudaIpcRef& ref = *m.ipc;
  DeviceScope scope(device);
  const cudaStream_t stream = transfer_stream(device);
  std::shared_ptr<void> mapping;
  cudaEvent_t produced = nullptr;
  try {
    mapping = link.mapping(ref.memory, [&] { return open_mapping(ref.memory, device); });
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, ref.event.data(), sizeof handle);
    if (cudaError_t e = cudaIpcOpenEventHandle(&produced, handle); e != cudaSuccess)
      throw RpcError(cuda_error("cudaIpcOpenEventHandle", e));
  } catch (const std::exception& e) {
    link.borrowing_failed(e.what());
    throw RpcError(std::string("a CUDA tensor lent by CUDA IPC could not be mapped: ") + e.what());
  }
  // The lender's stream has written the tensor once the event completes; the opened event is released once the wait
  // is satisfied.
  cudaError_t e = cudaStreamWaitEvent(stream, produced, 0);
  cudaEventDestroy(produced);
  check(e, "cudaStreamWaitEvent");
  const auto dtype = static_cast<at::ScalarType>(m.dtype);
  at::Tensor dev = device_empty(m.sizes, m.strides, dtype, device, stream);
  if (m.nbytes) {
    check(cudaMemcpyAsync(dev.data_ptr(), static_cast<const char*>(mapping.get()) + ref.offset,
                          static_cast<std::size_t>(m.nbytes), cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync");
    consumer_waits(device, stream);
  }
  complete_after(stream, transfer, {}, {std::move(mapping)});
  if (slot.requires_grad()) dev.set_requires_grad(true);
  slot = std::move(dev);
  cuda_ipc_counters().borrowed.fetch_add(1, std::memory_order_relaxed);
}
#endif

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
  cudaError_t e = cudaEventRecord(produced, producer_stream(device));
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
            const std::shared_ptr<DeviceTransfer>& transfer, const CudaIpcArrivals* ipc) {
  release_finished();
  std::map<std::size_t, const TensorMeta*> lent;  // the tensors lent by CUDA IPC, by index
  if (ipc)
    for (const auto& [i, m] : ipc->tensors) lent.emplace(i, &m);
  for (std::size_t i = 0; i < tensors.size() && i < devices.size(); ++i) {
    const int device = devices[i];
    if (device < 0) continue;
    if (auto it = lent.find(i); it != lent.end()) {
#if CORPC_TORCH_CUDA
      borrow(tensors[i], *it->second, *ipc->link, transfer);
      continue;
#else
      throw RpcError("a CUDA IPC tensor reached a corpc built against a CPU libtorch, which never agrees to CUDA IPC");
#endif
    }
    DeviceScope scope(device);
    const cudaStream_t stream = transfer_stream(device);
    const at::Tensor host = tensors[i];
    const std::size_t n = bytes_of(host);
    at::Tensor dev = device_empty(host.sizes(), host.strides(), host.scalar_type(), device, stream);
    if (n) {
      check(cudaMemcpyAsync(dev.data_ptr(), host.data_ptr(), n, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
      consumer_waits(device, stream);
      complete_after(stream, transfer, {host});
    }
    if (host.requires_grad()) dev.set_requires_grad(true);
    tensors[i] = std::move(dev);
  }
}

#if CORPC_TORCH_CUDA
bool ipc_capable() noexcept { return device_count() > 0; }

std::optional<CudaIpcRef> lend(const at::Tensor& t, CudaIpcLink& link) {
  const std::size_t n = static_cast<std::size_t>(t.numel()) * t.element_size();
  if (n == 0) return std::nullopt;  // nothing to lend: staging an empty tensor costs nothing
  const c10::Storage& storage = t.storage();
  if (storage.allocator() != c10::cuda::CUDACachingAllocator::get()) {
    link.lending_failed(
        "a CUDA tensor not made by libtorch's caching allocator (from_blob, say) cannot be lent: it "
        "goes through host memory",
        /*for_good=*/false);
    return std::nullopt;
  }
  const int device = t.device().index();
  CudaIpcRef ref;
  try {
    DeviceScope scope(device);
    std::size_t allocation = 0;
    void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(storage.data_ptr().get(), &allocation);
    const auto* first = static_cast<const char*>(t.data_ptr());
    if (first < static_cast<const char*>(base) || first + n > static_cast<const char*>(base) + allocation)
      throw RpcError("a tensor outside the allocation the caching allocator reports");
    ref.offset = static_cast<std::uint64_t>(first - static_cast<const char*>(base));
    ref.allocation_bytes = allocation;
    cudaIpcMemHandle_t memory;
    if (cudaError_t e = cudaIpcGetMemHandle(&memory, base); e != cudaSuccess)
      throw RpcError(cuda_error("cudaIpcGetMemHandle", e));
    std::memcpy(ref.memory.data(), &memory, sizeof memory);
    IpcEvent event = ipc_events().acquire(device);
    // The borrower's copy waits for this: everything the producer queued on its stream so far, the tensor included.
    if (cudaError_t e = cudaEventRecord(event.event, producer_stream(device)); e != cudaSuccess) {
      ipc_events().release(event);
      throw RpcError(cuda_error("cudaEventRecord", e));
    }
    std::memcpy(ref.event.data(), &event.handle, sizeof event.handle);
    ref.id = link.lend(std::make_shared<Loan>(t, event));
  } catch (const std::exception& e) {
    // getBaseAllocation refuses tensors of expandable segments and memory it did not cudaMalloc; the driver may
    // refuse IPC altogether: whichever, the same will happen to the next tensor.
    link.lending_failed(e.what(), /*for_good=*/true);
    return std::nullopt;
  }
  return ref;
}
#else  // a CPU build of libtorch: no caching allocator to find an allocation's base, so no lending
bool ipc_capable() noexcept { return false; }
std::optional<CudaIpcRef> lend(const at::Tensor&, CudaIpcLink&) { return std::nullopt; }
#endif

#if CORPC_TORCH_CUDA
at::Tensor copy_to_device(const at::Tensor& host, int device) {
  return host.to(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
}

at::Tensor copy_to_host(const at::Tensor& t) { return t.to(at::kCPU); }
#else
at::Tensor copy_to_device(const at::Tensor& host, int device) {
  const at::Tensor src = host.contiguous();
  DeviceScope scope(device);
  void* p = nullptr;
  if (bytes_of(src)) check(cudaMalloc(&p, bytes_of(src)), "cudaMalloc");
  const c10::Device target(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  at::Tensor dev = at::from_blob(
      p, src.sizes(), src.strides(), [](void* q) { cudaFree(q); }, src.options().device(target), target);
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
#endif

}  // namespace corpc::detail::cuda
