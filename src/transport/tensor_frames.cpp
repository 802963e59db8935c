// Tensor metadata on the wire: dtype, shape, strides and requires_grad per tensor; the bytes travel separately.
#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <limits>

#include "corpc/wire/codec.hpp"

#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"
#include "memory/host_block_cache.hpp"
#include "transport/frames.hpp"
#include "transport/shm_transfer.hpp"
#include "wire/device_map.hpp"
#include "wire/tensor_meta.hpp"

namespace corpc {

namespace {
// Bytes spanned by a non-overlapping, dense layout: exactly numel * itemsize, starting at data_ptr().
std::uint64_t dense_bytes(const at::Tensor& t) { return static_cast<std::uint64_t>(t.numel()) * t.element_size(); }

std::size_t item_size(std::uint8_t raw) {
  if (raw >= static_cast<std::uint8_t>(at::ScalarType::NumOptions) ||
      raw == static_cast<std::uint8_t>(at::ScalarType::Undefined))
    return 0;
  return c10::elementSize(static_cast<at::ScalarType>(raw));
}
void give_back_block(void* data) { detail::HostBlockCache::instance().release(data); }

// A tensor to receive `m` into: large ones in a block of the block cache (given back when the storage is freed; a
// resize moves the tensor to the CPU allocator), the rest from the CPU allocator.
at::Tensor receive_tensor(const detail::TensorMeta& m) {
  const auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(m.dtype));
  void* block = detail::HostBlockCache::instance().acquire(static_cast<std::size_t>(m.nbytes));
  if (!block) return at::empty_strided(m.sizes, m.strides, options);
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::size_t>(m.nbytes),
                       c10::DataPtr(block, block, &give_back_block, at::Device(at::kCPU)), c10::GetCPUAllocator(),
                       /*resizable=*/true);
  at::Tensor t = at::empty({0}, options);
  t.set_(std::move(storage), 0, m.sizes, m.strides);
  return t;
}

// A tensor bound for a CUDA device (m.device >= 0): its delivery device recorded as tensor `i` of `count` in
// `devices` (Message::devices), its bytes received into a pinned staging buffer the runtime uploads from.
at::Tensor receive_for_device(const detail::TensorMeta& m, std::size_t i, std::size_t count,
                              std::vector<std::int8_t>* devices) {
  if (!devices) throw ProtocolError("a tensor for a CUDA device where none is accepted");
  devices->resize(count, -1);
  (*devices)[i] = m.device;
  return detail::cuda::host_receive_buffer(m.sizes, m.strides, static_cast<at::ScalarType>(m.dtype));
}

// What stands in a message's tensor list for a tensor lent by CUDA IPC until it is copied to its device: no bytes (the
// frame carries none for it), its dtype and number of dimensions (what the limits check).
at::Tensor lent_placeholder(std::uint8_t dtype, std::size_t dim) {
  return at::empty(std::vector<std::int64_t>(dim, 0), at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)));
}

// A tensor lent by CUDA IPC (m.ipc): recorded as tensor `i` of `count` in `devices` and in `*ipc` (made on the first),
// a placeholder in the message meanwhile.
at::Tensor receive_lent(const detail::TensorMeta& m, std::size_t i, std::size_t count,
                        std::vector<std::int8_t>* devices, std::shared_ptr<detail::CudaIpcArrivals>* ipc) {
  if (!devices || !ipc) throw ProtocolError("a CUDA IPC tensor where none is accepted");
  devices->resize(count, -1);
  (*devices)[i] = m.device;
  if (!*ipc) *ipc = std::make_shared<detail::CudaIpcArrivals>();
  (*ipc)->tensors.emplace_back(i, m);
  return lent_placeholder(m.dtype, m.sizes.size());
}

bool differentiable(std::uint8_t raw) {
  const auto dtype = static_cast<at::ScalarType>(raw);
  return at::isFloatingType(dtype) || at::isComplexType(dtype);
}
}  // namespace

namespace detail {

std::vector<at::Tensor> encode_tensor_meta(const std::vector<at::Tensor>& tensors, std::string& meta,
                                           std::uint64_t& total_bytes, const DeviceMap& map, std::string_view receiver,
                                           std::shared_ptr<detail::DeviceTransfer>* staged,
                                           const std::shared_ptr<detail::CudaIpcLink>& ipc,
                                           std::shared_ptr<detail::CudaIpcLoans>* lent) {
  std::vector<at::Tensor> wire;
  wire.reserve(tensors.size());
  Writer w(meta);
  total_bytes = 0;
  for (const auto& original : tensors) {
    at::Tensor t = original;
    if (t.is_sparse() || t.is_quantized()) throw UsageError("corpc sends dense tensors only");
    // CUDA tensors follow the device map (a device without an entry is an error here, at the caller).
    const std::int8_t device = t.is_cuda() ? detail::map_device(map, t.device(), receiver).index() : -1;
    if (!t.is_cuda() && !t.device().is_cpu()) t = t.to(at::kCPU);
    // Dense layouts (contiguous, transposed, channels-last...) go as they are; views with gaps send their elements.
    if (!t.is_non_overlapping_and_dense()) t = t.contiguous();
    // Lent by CUDA IPC where the connection agreed to it and this tensor can be; staged through host memory otherwise.
    std::optional<detail::CudaIpcRef> loan;
    if (device >= 0 && ipc && lent && ipc->lending()) loan = detail::cuda::lend(t, *ipc);
    if (loan) {
      if (!*lent) *lent = std::make_shared<detail::CudaIpcLoans>(ipc);
      (*lent)->add(loan->id, dense_bytes(t));
    } else if (device >= 0) {
      if (!staged) throw UsageError("a CUDA tensor in a message that cannot wait for its copy");
      if (!*staged) *staged = std::make_shared<detail::DeviceTransfer>();
      t = detail::cuda::stage_to_host(t, *staged);
    }
    w.put(static_cast<std::uint8_t>(t.scalar_type()));
    w.put(static_cast<std::uint8_t>(t.dim()));
    for (auto s : t.sizes()) w.put(static_cast<std::int64_t>(s));
    for (auto s : t.strides()) w.put(static_cast<std::int64_t>(s));
    w.put(static_cast<std::uint8_t>((original.requires_grad() ? detail::kTensorRequiresGrad : 0) |
                                    (device >= 0 ? detail::kTensorOnDevice : 0) | (loan ? detail::kTensorCudaIpc : 0)));
    if (device >= 0) w.put(device);
    std::uint64_t n = dense_bytes(t);
    w.put(n);
    if (loan) {
      detail::write_cuda_ipc_ref(meta, *loan);
      wire.push_back(lent_placeholder(static_cast<std::uint8_t>(t.scalar_type()), static_cast<std::size_t>(t.dim())));
      continue;  // its bytes stay on the device: none in the frame
    }
    total_bytes += n;
    wire.push_back(t.detach());
  }
  return wire;
}

std::vector<at::Tensor> decode_tensor_meta(const char* meta, std::size_t meta_len, std::uint32_t num_tensors,
                                           std::uint64_t total_bytes, const WireLimits& limits,
                                           std::vector<std::int8_t>* devices,
                                           std::shared_ptr<detail::CudaIpcArrivals>* ipc) {
  auto table = detail::parse_tensor_meta(meta, meta_len, num_tensors, total_bytes, limits,
                                         {&item_size, &differentiable}, ipc != nullptr);
  std::vector<at::Tensor> out;
  out.reserve(table.size());
  for (std::size_t i = 0; i < table.size(); ++i) {
    const auto& m = table[i];
    at::Tensor t = m.ipc           ? receive_lent(m, i, table.size(), devices, ipc)
                   : m.device >= 0 ? receive_for_device(m, i, table.size(), devices)
                                   : receive_tensor(m);
    if (m.requires_grad) t.set_requires_grad(true);
    out.push_back(std::move(t));
  }
  return out;
}

OutFrame prepare(Message&& msg, const DeviceMap& map, std::string_view receiver,
                 const std::shared_ptr<detail::CudaIpcLink>& ipc) {
  OutFrame f;
  f.head = msg.head;
  std::uint64_t total = 0;
  if (!msg.tensors.empty())
    f.tensors = encode_tensor_meta(msg.tensors, f.meta, total, map, receiver, &f.staged, ipc, &f.lent);
  if (f.staged) f.staged->seal();
  f.head.meta_len = static_cast<std::uint32_t>(f.meta.size());
  f.head.body_len = static_cast<std::uint32_t>(msg.body.size());
  f.head.num_tensors = static_cast<std::uint32_t>(f.tensors.size());
  f.head.tensor_bytes = total;
  f.body = std::move(msg.body);
  // Checked here, against our own limits' hard ceiling, so that no length is ever truncated by the 32-bit fields.
  if (f.body.size() > std::numeric_limits<std::uint32_t>::max() ||
      f.meta.size() > std::numeric_limits<std::uint32_t>::max())
    throw MessageTooLargeError("message body of " + std::to_string(f.body.size()) +
                               " bytes cannot be framed (4 GiB at most)");
  return f;
}

void check_request_budget(const OutFrame& f, const WireLimits& lim, const std::string& receiver) {
  const std::uint64_t n = f.wire_bytes();
  if (n > lim.max_request_bytes)
    throw MessageTooLargeError("a request of " + std::to_string(n) + " bytes is over the " +
                               std::to_string(lim.max_request_bytes) + " that worker '" + receiver +
                               "' may hold (its RpcOptions::receive_budget_per_connection / _per_process)");
}

void check_limits(const OutFrame& f, const WireLimits& lim, const std::string& receiver) {
  auto refuse = [&](const std::string& what, std::uint64_t n, std::uint64_t limit) {
    throw MessageTooLargeError(what + " of " + std::to_string(n) + " bytes is over the " + std::to_string(limit) +
                               " that worker '" + receiver + "' accepts (its RpcOptions::limits)");
  };
  if (f.body.size() > lim.max_body_bytes) refuse("message body", f.body.size(), lim.max_body_bytes);
  if (f.meta.size() > lim.max_meta_bytes) refuse("tensor metadata", f.meta.size(), lim.max_meta_bytes);
  if (f.tensors.size() > lim.max_tensors)
    throw MessageTooLargeError(std::to_string(f.tensors.size()) + " tensors are more than worker '" + receiver +
                               "' accepts in one message (" + std::to_string(lim.max_tensors) + ")");
  // Tensors lent by CUDA IPC count as if they travelled: the receiver allocates them all the same.
  const std::uint64_t tensor_bytes = f.head.tensor_bytes + (f.lent ? f.lent->bytes() : 0);
  if (tensor_bytes > lim.max_tensor_bytes) refuse("tensor data", tensor_bytes, lim.max_tensor_bytes);
  for (const auto& t : f.tensors)
    if (static_cast<std::uint32_t>(t.dim()) > lim.max_dims)
      throw MessageTooLargeError("a tensor of " + std::to_string(t.dim()) + " dimensions is more than worker '" +
                                 receiver + "' accepts");
}

namespace {
std::uint64_t aligned(std::uint64_t n) { return (n + kShmAlign - 1) / kShmAlign * kShmAlign; }

// What holds a received region of the ring: the channel (and so its mapping) stays alive while any tensor of the
// region does, and the region goes back to the sender when the last of them is freed.
struct RingLease {
  RingLease(std::shared_ptr<ShmChannel> c, std::uint64_t o) : channel(std::move(c)), offset(o) {}
  RingLease(const RingLease&) = delete;
  RingLease& operator=(const RingLease&) = delete;
  ~RingLease() { channel->release(offset); }
  std::shared_ptr<ShmChannel> channel;
  std::uint64_t offset;
};
void drop_lease(void* ctx) { delete static_cast<std::shared_ptr<RingLease>*>(ctx); }
}  // namespace

bool shm_send(ShmChannel& channel, OutFrame& f) {
  if (!channel.can_send() || shm_sends_paused()) return false;
  std::uint64_t len = 0;
  for (const auto& t : f.tensors) len += aligned(static_cast<std::uint64_t>(t.nbytes()));
  auto region = channel.reserve(len);
  if (!region) return false;
  std::uint64_t off = 0;
  for (const auto& t : f.tensors) {
    const auto n = static_cast<std::size_t>(t.nbytes());
    if (n) std::memcpy(region->data + off, t.data_ptr(), n);
    off += aligned(n);
  }
  Writer(f.meta).put(region->offset);
  f.head.meta_len = static_cast<std::uint32_t>(f.meta.size());
  f.head.flags |= kFlagShm;
  f.tensors.clear();
  auto& c = shm_counters();
  c.bytes_sent.fetch_add(f.head.tensor_bytes, std::memory_order_relaxed);
  c.messages_sent.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::vector<at::Tensor> shm_receive(const std::shared_ptr<ShmChannel>& channel, const FrameHeader& h, const char* meta,
                                    std::size_t meta_len, const WireLimits& limits, std::vector<std::int8_t>* devices,
                                    std::shared_ptr<CudaIpcArrivals>* ipc) {
  if (meta_len < sizeof(std::uint64_t)) throw ProtocolError("a same-host frame without its ring position");
  meta_len -= sizeof(std::uint64_t);
  std::uint64_t offset;
  std::memcpy(&offset, meta + meta_len, sizeof offset);
  auto table = parse_tensor_meta(meta, meta_len, h.num_tensors, h.tensor_bytes, limits, {&item_size, &differentiable},
                                 ipc != nullptr);
  std::uint64_t len = 0;
  for (const auto& m : table) len += aligned(m.wire_bytes());
  char* data = channel->receive(offset, len);
  const bool in_place = channel->held_bytes() <= channel->ring_bytes() / 2;
  auto lease = in_place ? std::make_shared<RingLease>(channel, offset) : nullptr;
  std::vector<at::Tensor> out;
  out.reserve(table.size());
  std::uint64_t off = 0;
  for (std::size_t i = 0; i < table.size(); ++i) {
    const auto& m = table[i];
    at::Tensor t;
    if (m.ipc) {  // lent by CUDA IPC: nothing in the ring
      t = receive_lent(m, i, table.size(), devices, ipc);
    } else if (m.device >= 0) {  // bound for a device: copied out of the ring into its staging buffer
      t = receive_for_device(m, i, table.size(), devices);
      if (m.nbytes) std::memcpy(t.data_ptr(), data + off, static_cast<std::size_t>(m.nbytes));
    } else if (in_place) {
      const auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(m.dtype));
      c10::Storage storage(
          c10::Storage::use_byte_size_t(), static_cast<std::size_t>(m.nbytes),
          c10::DataPtr(data + off, new std::shared_ptr<RingLease>(lease), &drop_lease, at::Device(at::kCPU)),
          c10::GetCPUAllocator(), /*resizable=*/true);
      t = at::empty({0}, options);
      t.set_(std::move(storage), 0, m.sizes, m.strides);
    } else {
      t = receive_tensor(m);
      if (m.nbytes) std::memcpy(t.data_ptr(), data + off, static_cast<std::size_t>(m.nbytes));
    }
    if (m.requires_grad) t.set_requires_grad(true);
    off += aligned(m.wire_bytes());
    out.push_back(std::move(t));
  }
  if (!in_place) channel->release(offset);
  auto& c = shm_counters();
  c.bytes_received.fetch_add(h.tensor_bytes, std::memory_order_relaxed);
  c.messages_received.fetch_add(1, std::memory_order_relaxed);
  return out;
}

}  // namespace detail

}  // namespace corpc
