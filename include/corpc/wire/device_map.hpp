/// @file
/// Device maps: where a CUDA tensor sent to another worker arrives (PyTorch's `set_device_map`).
///
///   corpc::RpcOptions o;
///   o.set_device_map("worker1", {{c10::Device("cuda:0"), c10::Device("cuda:1")}});  // our cuda:0 -> its cuda:1
///
/// A worker uses one map with each peer, in both directions: the peer's own map back to us, if it sets one, must be
/// the inverse (checked at init_rpc on every worker), so requests, replies, RRef values, RemoteModule outputs and
/// the gradients of distributed autograd all follow the same pairs. CPU tensors always arrive on the CPU; a CUDA
/// tensor on a device the map to its destination does not name fails the call at the caller with UsageError.
#pragma once

#include <c10/core/Device.h>

#include <unordered_map>

namespace corpc {

/// One worker's devices to another's: `{cuda:i -> cuda:j}`, one to one, CUDA devices with an explicit index only.
using DeviceMap = std::unordered_map<c10::Device, c10::Device>;

}  // namespace corpc
