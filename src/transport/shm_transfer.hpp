// Tensor data through a same-host channel's ring (src/transport/shm_channel.hpp), on either side of a connection. The frame on
// TCP keeps its header and tensor table; kFlagShm says the data is in the ring, at the virtual position held in the
// table's last 8 bytes. In the ring each tensor starts at kShmAlign.
#pragma once

#include <memory>
#include <vector>

#include "transport/frames.hpp"
#include "transport/shm_channel.hpp"

namespace corpc::detail {

// Sender, under the connection's write lock (regions are reserved in frame order): copies `f`'s tensor data into the
// ring and rewrites `f` to announce it there. False (and `f` untouched) if the channel cannot take it now.
bool shm_send(ShmChannel& channel, OutFrame& f);

// Receiver, on the I/O thread, for a frame with kFlagShm: its tensors, from the ring. While the receiver holds less
// than half the ring they are views of it (their region is released when the last of them is freed); otherwise they
// are copied out at once, so that a receiver that keeps what it gets cannot hold up its sender for long.
// `devices` and `ipc` as for decode_tensor_meta: tensors bound for a CUDA device are copied out into their staging
// buffers; tensors lent by CUDA IPC have no bytes in the ring.
std::vector<at::Tensor> shm_receive(const std::shared_ptr<ShmChannel>& channel, const FrameHeader& h, const char* meta,
                                    std::size_t meta_len, const WireLimits& limits, std::vector<std::int8_t>* devices,
                                    std::shared_ptr<CudaIpcArrivals>* ipc = nullptr);

}  // namespace corpc::detail
