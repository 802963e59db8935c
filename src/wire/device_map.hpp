// Device maps (corpc/wire/device_map.hpp): checking them, exchanging them at rendezvous, and mapping a tensor's
// device on send. Plain C++ over c10::Device, unit-tested on machines without a GPU (tests/test_device_map.cpp).
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/wire/device_map.hpp"

namespace corpc::detail {

// Throws UsageError unless `d` is a CUDA device with an explicit index (`what` names it in the message).
void check_cuda_device(const c10::Device& d, std::string_view what);
// Throws UsageError unless `map` is one to one between CUDA devices with indices (`worker` names it in messages).
void check_invertible(const DeviceMap& map, std::string_view worker);
// `map` read backwards; `map` must be invertible.
DeviceMap inverse(const DeviceMap& map);

// What a worker announces when it registers (rendezvous): its CUDA device count, the devices it declared for RPC,
// and its maps by destination name. Travels as an opaque blob in the Hello and the World table.
struct DeviceConfig {
  int device_count = 0;
  std::vector<c10::Device> devices;
  std::map<std::string, DeviceMap> maps;
};
std::string encode_device_config(const DeviceConfig& config);
// Throws ProtocolError if malformed (an empty blob is an empty config).
DeviceConfig decode_device_config(std::string_view bytes);

// This worker's view of the job's devices, once every worker's config is known.
struct ResolvedDevices {
  std::vector<DeviceMap> by_rank;    // the map used with each rank, in both directions (empty: CPU tensors only)
  std::vector<c10::Device> devices;  // this worker's CUDA devices that RPC uses, by index
};
// Checks every worker's config against the others' (PyTorch's rules: devices exist and are declared, maps are one
// to one and name known workers; and ours: a map back, where both set one, is the inverse) and returns `self`'s
// view. Throws UsageError naming the worker and the entry at fault; every worker reaches the same verdict.
ResolvedDevices resolve_device_maps(int self, const std::vector<std::string>& names,
                                    const std::vector<DeviceConfig>& configs);

// Where a tensor on `from` arrives when sent with `map` to worker `peer`: CPU stays CPU; a CUDA device without an
// entry throws UsageError (as PyTorch does), naming `peer`.
c10::Device map_device(const DeviceMap& map, const c10::Device& from, std::string_view peer);

}  // namespace corpc::detail
