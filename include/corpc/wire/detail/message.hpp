// corpc/wire/detail/message.hpp — one framed message as the RPC layer sees it: a typed header, an encoded body and
// tensors (internal). How it becomes bytes on a socket (OutFrame, prepare) is the transport's: src/transport/frames.hpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/wire/detail/frame.hpp"

namespace corpc::detail {

struct CudaIpcArrivals;

// A message as the RPC layer builds and receives it: header fields, codec bytes and the tensors they refer to.
struct Message {
  FrameHeader head;                 // kind, ids, flags; the lengths are filled in when the message is prepared
  std::string body;                 // codec bytes; tensors appear in it as indices into `tensors`
  std::vector<at::Tensor> tensors;  // sent out of band
  // Received only: for each tensor, the CUDA device it is to be delivered on (-1: the CPU), as the sender's device
  // map chose; empty when all stay on the CPU. The runtime copies them there before delivering the message.
  std::vector<std::int8_t> devices;
  // Received only: the tensors a peer on this host lent by CUDA IPC (their `tensors` entries are placeholders until
  // the runtime has copied them to their devices); null when none.
  std::shared_ptr<CudaIpcArrivals> ipc;
};

}  // namespace corpc::detail
