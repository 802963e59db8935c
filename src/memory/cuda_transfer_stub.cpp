// The CUDA data path in a build without the CUDA toolkit: no devices, no CUDA IPC, and a clear error if a tensor asks
// for a device.
#include <ATen/ATen.h>

#include "corpc/wire/errors.hpp"

#include "memory/cuda_transfer.hpp"

namespace corpc::detail::cuda {

namespace {
[[noreturn]] void unavailable() {
  throw UsageError(
      "a CUDA tensor reached corpc's CUDA path, but this corpc was built without CUDA (meson -Dcuda=enabled)");
}
}  // namespace

bool built_with_cuda() noexcept { return false; }
int device_count() noexcept { return 0; }
at::Tensor stage_to_host(const at::Tensor&, const std::shared_ptr<DeviceTransfer>&) { unavailable(); }
at::Tensor host_receive_buffer(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  return at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
}
void upload(std::vector<at::Tensor>&, const std::vector<std::int8_t>&, const std::shared_ptr<DeviceTransfer>&,
            const CudaIpcArrivals*) {
  unavailable();
}
// No CUDA, no CUDA IPC: the handshake never agrees to it, so nothing is lent or borrowed here.
bool ipc_capable() noexcept { return false; }
std::optional<CudaIpcRef> lend(const at::Tensor&, CudaIpcLink&) { return std::nullopt; }
at::Tensor copy_to_device(const at::Tensor&, int) { unavailable(); }
at::Tensor copy_to_host(const at::Tensor&) { unavailable(); }

}  // namespace corpc::detail::cuda
