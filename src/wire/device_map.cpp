// Device maps: checks, exchange and mapping (see device_map.hpp).
#include "wire/device_map.hpp"

#include <algorithm>

#include "corpc/wire/codec.hpp"

namespace corpc {

namespace detail {

namespace {
std::string str(const c10::Device& d) { return d.str(); }

std::string describe(const DeviceMap& map) {
  std::vector<std::pair<int, int>> pairs;
  for (const auto& [from, to] : map) pairs.emplace_back(from.index(), to.index());
  std::sort(pairs.begin(), pairs.end());
  std::string s = "{";
  for (const auto& [from, to] : pairs)
    s += (s.size() > 1 ? ", cuda:" : "cuda:") + std::to_string(from) + " -> cuda:" + std::to_string(to);
  return s + "}";
}

bool same_map(const DeviceMap& a, const DeviceMap& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [k, v] : a) {
    auto it = b.find(k);
    if (it == b.end() || it->second != v) return false;
  }
  return true;
}

}  // namespace

void check_cuda_device(const c10::Device& d, std::string_view what) {
  if (!d.is_cuda())
    throw UsageError(std::string(what) + ": " + str(d) +
                     " is not a CUDA device (CPU tensors always arrive on the CPU; "
                     "device maps and devices name CUDA devices only)");
  if (!d.has_index()) throw UsageError(std::string(what) + ": name the CUDA device's index (cuda:0, not cuda)");
}

void check_invertible(const DeviceMap& map, std::string_view worker) {
  const std::string what = "device map to '" + std::string(worker) + "'";
  std::unordered_map<c10::Device, c10::Device> seen;  // target -> source
  for (const auto& [from, to] : map) {
    check_cuda_device(from, what);
    check_cuda_device(to, what);
    auto [it, fresh] = seen.emplace(to, from);
    if (!fresh)
      throw UsageError(what + " is not invertible: " + str(it->second) + " and " + str(from) + " both map to " +
                       str(to));
  }
}

DeviceMap inverse(const DeviceMap& map) {
  DeviceMap out;
  for (const auto& [from, to] : map) out.emplace(to, from);
  return out;
}

std::string encode_device_config(const DeviceConfig& c) {
  std::string out;
  Writer w(out);
  w.put(static_cast<std::int32_t>(c.device_count));
  w.put(static_cast<std::uint32_t>(c.devices.size()));
  for (const auto& d : c.devices) w.put(static_cast<std::int8_t>(d.index()));
  w.put(static_cast<std::uint32_t>(c.maps.size()));
  for (const auto& [worker, map] : c.maps) {
    w.put(worker);
    w.put(static_cast<std::uint32_t>(map.size()));
    for (const auto& [from, to] : map) {
      w.put(static_cast<std::int8_t>(from.index()));
      w.put(static_cast<std::int8_t>(to.index()));
    }
  }
  return out;
}

DeviceConfig decode_device_config(std::string_view bytes) {
  DeviceConfig c;
  if (bytes.empty()) return c;
  Reader r(bytes.data(), bytes.size());
  auto cuda = [&r] {
    const auto index = r.get<std::int8_t>();
    if (index < 0) throw ProtocolError("device config: CUDA device index " + std::to_string(index));
    return c10::Device(c10::kCUDA, index);
  };
  c.device_count = r.get<std::int32_t>();
  for (auto n = r.count(1); n > 0; --n) c.devices.push_back(cuda());
  for (auto n = r.count(5); n > 0; --n) {
    auto worker = r.get<std::string>();
    auto& map = c.maps[worker];
    for (auto m = r.count(2); m > 0; --m) {
      const auto from = cuda();
      map.insert_or_assign(from, cuda());
    }
  }
  if (r.remaining()) throw ProtocolError("device config: trailing bytes");
  return c;
}

ResolvedDevices resolve_device_maps(int self, const std::vector<std::string>& names,
                                    const std::vector<DeviceConfig>& configs) {
  const int world = static_cast<int>(names.size());
  std::map<std::string, int> rank_of;
  for (int r = 0; r < world; ++r) rank_of[names[r]] = r;
  auto fail = [&](int r, const std::string& why) { throw UsageError("device maps: worker '" + names[r] + "' " + why); };
  // Devices a worker may use: those it declared, else those it has.
  auto usable = [&](int r, const c10::Device& d) {
    const auto& declared = configs[r].devices;
    if (!declared.empty()) return std::find(declared.begin(), declared.end(), d) != declared.end();
    return d.index() < configs[r].device_count;
  };
  auto where = [&](int r) {
    return configs[r].devices.empty() ? " (it has " + std::to_string(configs[r].device_count) + " CUDA devices)"
                                      : " (not among its devices)";
  };
  for (int r = 0; r < world; ++r) {
    const auto& c = configs[r];
    std::set<int> declared;
    for (const auto& d : c.devices) {
      if (!declared.insert(d.index()).second) fail(r, "declares " + str(d) + " twice in its devices");
      if (d.index() >= c.device_count)
        fail(r, "declares " + str(d) + " but has " + std::to_string(c.device_count) + " CUDA devices");
    }
    for (const auto& [peer, map] : c.maps) {
      auto it = rank_of.find(peer);
      if (it == rank_of.end()) fail(r, "has a device map to '" + peer + "', which is not a worker of this job");
      if (it->second == r)
        fail(r, "has a device map to itself (calls to oneself keep tensors where they are; set maps per worker)");
      check_invertible(map, peer);
      for (const auto& [from, to] : map) {
        if (!usable(r, from)) fail(r, "maps " + str(from) + " to '" + peer + "'" + where(r));
        if (!usable(it->second, to))
          fail(r, "maps " + str(from) + " to " + str(to) + " on '" + peer + "'" + where(it->second));
      }
      // One map per pair: a map back, if set, must be the inverse, so that replies and gradients retrace requests.
      const auto& back = configs[it->second].maps;
      if (auto b = back.find(names[r]); b != back.end() && !same_map(b->second, inverse(map)))
        fail(r, "maps " + describe(map) + " to '" + peer + "', but '" + peer + "' maps " + describe(b->second) +
                    " back, which is not its inverse (replies and gradients follow the inverse of a map; set one of "
                    "the two, or make them mutual inverses)");
    }
  }
  ResolvedDevices out;
  out.by_rank.resize(world);
  std::set<int> used;
  for (int r = 0; r < world; ++r) {
    if (r == self) {  // calls to oneself: every device to itself
      for (int i = 0; i < configs[self].device_count && i < 128; ++i)
        out.by_rank[r].emplace(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)),
                               c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      continue;
    }
    if (auto it = configs[self].maps.find(names[r]); it != configs[self].maps.end()) {
      out.by_rank[r] = it->second;
    } else if (auto back = configs[r].maps.find(names[self]); back != configs[r].maps.end()) {
      out.by_rank[r] = inverse(back->second);
    }
    for (const auto& [from, to] : out.by_rank[r]) used.insert(from.index());
  }
  for (const auto& d : configs[self].devices) used.insert(d.index());
  for (int i : used) out.devices.emplace_back(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
  return out;
}

c10::Device map_device(const DeviceMap& map, const c10::Device& from, std::string_view peer) {
  if (from.is_cpu()) return from;
  auto it = map.find(from);
  if (it != map.end()) return it->second;
  if (map.empty())
    throw UsageError("a tensor on " + str(from) + " cannot be sent to worker '" + std::string(peer) +
                     "': no device map to it (move the tensor to the CPU, or RpcOptions::set_device_map(\"" +
                     std::string(peer) + "\", {{" + str(from) + ", ...}}))");
  throw UsageError("a tensor on " + str(from) + " cannot be sent to worker '" + std::string(peer) +
                   "': its device map " + describe(map) + " has no entry for " + str(from));
}

}  // namespace detail

}  // namespace corpc
