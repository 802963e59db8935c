// The CUDA data path of tensor transfers (src/memory/cuda_transfer.cpp, built when Meson finds the CUDA toolkit;
// src/memory/cuda_transfer_stub.cpp otherwise). Two builds of it:
// - against a CPU build of libtorch (Debian's), on the CUDA runtime API only: there is no c10::cuda, so corpc cannot
//   see the stream a tensor was produced on and orders its copies after the legacy default stream (PyTorch's default
//   stream) instead, and allocates device memory itself; see docs/cuda.md;
// - against a CUDA build of libtorch (CORPC_TORCH_CUDA): copies are ordered after the producer's current stream,
//   received tensors come from libtorch's caching allocator, and peers on this host may be lent tensors by CUDA IPC
//   (src/memory/cuda_ipc.hpp).
//
// Sending: the tensor is copied into pinned host memory on a corpc-owned transfer stream of its device, which first
// waits for an event recorded on the producer's stream; a host function enqueued after the copy completes the
// DeviceTransfer part, and the frame is written from there (no thread blocks on the copy). Receiving: the bytes land in
// pinned memory, are copied to the mapped device on that device's transfer stream, and the message is delivered once
// the copy is done, its tensors on the mapped devices. By CUDA IPC, the transfer stream copies device to device from
// the lender's memory instead.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "memory/device_transfer.hpp"
#include "wire/tensor_meta.hpp"

namespace corpc::detail {
class CudaIpcLink;
struct CudaIpcArrivals;
}  // namespace corpc::detail

namespace corpc::detail::cuda {

// Whether this corpc was built with the CUDA data path.
bool built_with_cuda() noexcept;
// CUDA devices visible to this process (0 without a driver or device, and in a build without CUDA).
int device_count() noexcept;

// Starts copying CUDA tensor `t` into pinned host memory, adds the copy to `transfer` and returns the host tensor (a
// dense layout as t's: same sizes and strides). Keeps `t` alive until the copy is done. Throws UsageError in a
// build without CUDA, RpcError when the CUDA runtime refuses.
at::Tensor stage_to_host(const at::Tensor& t, const std::shared_ptr<DeviceTransfer>& transfer);

// An empty host tensor to receive a tensor bound for a device in: pinned when the CUDA path is built and a device
// present, pageable otherwise.
at::Tensor host_receive_buffer(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype);

// Starts copying `host[i]` to cuda:devices[i] for each devices[i] >= 0, replacing host[i] with the device tensor,
// each copy a part of `transfer`; the tensors in `ipc` (lent by a peer on this host) are copied from the lender's
// memory instead. Throws as stage_to_host; a lent tensor that cannot be mapped throws RpcError and tells ipc->link.
void upload(std::vector<at::Tensor>& tensors, const std::vector<std::int8_t>& devices,
            const std::shared_ptr<DeviceTransfer>& transfer, const CudaIpcArrivals* ipc = nullptr);

// Whether this process can lend and borrow CUDA tensors by CUDA IPC: built against a CUDA libtorch (whose caching
// allocator tells an allocation's base) and a device present.
bool ipc_capable() noexcept;
// Lends dense CUDA tensor `t` to the peer of `link`: its allocation's handle and offset, an interprocess event
// recorded on the current stream of its device on this thread (the producer's), and the loan the link keeps (with
// `t`) until the peer returns it. nullopt when `t` cannot be lent (the link is told why): it is staged instead.
std::optional<CudaIpcRef> lend(const at::Tensor& t, CudaIpcLink& link);

// Blocking copies for tests on a machine with a GPU (a CPU build of libtorch cannot move a tensor to a device itself;
// a CUDA build does it with `.to()`).
at::Tensor copy_to_device(const at::Tensor& host, int device);
at::Tensor copy_to_host(const at::Tensor& t);

}  // namespace corpc::detail::cuda

namespace corpc::detail {

// This process's CUDA device count: the CUDA runtime's (0 without a device, or in a build without CUDA), unless a
// test set one (a map is checked against it: tests on machines without a GPU pretend to have some).
int local_cuda_device_count();
void set_cuda_device_count_for_testing(int count);  // < 0: the real count again

}  // namespace corpc::detail
