// RpcOptions' setters: device maps and devices are checked as they are set, so a mistake fails where it is made.
#include "corpc/rpc/options.hpp"

#include <set>

#include "corpc/core/errors.hpp"

#include "wire/device_map.hpp"

namespace corpc {

void RpcOptions::set_device_map(const std::string& worker, const DeviceMap& map) {
  detail::check_invertible(map, worker);
  DeviceMap merged;
  if (auto it = device_maps.find(worker); it != device_maps.end()) merged = it->second;
  for (const auto& [from, to] : map) {
    auto [it, fresh] = merged.emplace(from, to);
    if (!fresh && it->second != to)
      throw UsageError("device map to '" + worker + "': " + from.str() + " is mapped to " + it->second.str() +
                       " already, not " + to.str());
  }
  detail::check_invertible(merged, worker);
  device_maps[worker] = std::move(merged);
}

void RpcOptions::set_devices(std::vector<c10::Device> list) {
  std::set<int> seen;
  for (const auto& d : list) {
    detail::check_cuda_device(d, "RpcOptions::devices");
    if (!seen.insert(d.index()).second) throw UsageError("RpcOptions::devices: " + d.str() + " is listed twice");
  }
  devices = std::move(list);
}

}  // namespace corpc
