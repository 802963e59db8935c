/// @file
/// The identity of a worker, and the ways to name one in a call.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "corpc/wire/codec.hpp"

namespace corpc {

/// One worker of the job, as every worker learns it at init_rpc (get_worker_info, get_worker_infos). Encodable.
struct WorkerInfo {
  std::string name;                                    ///< the name given to init_rpc, unique in the job
  int rank = -1;                                       ///< 0 .. world_size-1
  std::string host;                                    ///< address its listener is reachable at
  std::uint16_t port = 0;                              ///< its listener's port
  bool operator==(const WorkerInfo&) const = default;  ///< field by field
  CORPC_FIELDS(name, rank, host, port)
};

/// Names a destination by rank, by name, or by WorkerInfo; resolved (and checked) when the call is made: an unknown
/// one fails that call's future with UnknownWorkerError. Converts implicitly, so calls take `1`, `"worker1"` or a
/// WorkerInfo where a WorkerRef is expected.
class WorkerRef {
 public:
  /// By rank.
  WorkerRef(int rank) : rank_(rank) {}  // NOLINT: implicit by design
  /// By name (the one given to init_rpc).
  WorkerRef(std::string_view name) : name_(name) {}  // NOLINT
  /// By name.
  WorkerRef(const char* name) : name_(name) {}  // NOLINT
  /// By name.
  WorkerRef(const std::string& name) : name_(name) {}  // NOLINT
  /// The worker `info` describes (its name and rank).
  WorkerRef(const WorkerInfo& info) : rank_(info.rank), name_(info.name) {}  // NOLINT
  /// The rank given, or -1 if named by name only.
  int rank() const noexcept { return rank_; }
  /// The name given, or empty if named by rank only. A name takes precedence when the reference is resolved.
  const std::string& name() const noexcept { return name_; }

 private:
  int rank_ = -1;
  std::string name_;
};

namespace detail {
// "worker/device" (RemoteModule's and the pipeline's remote_device) as {worker, device}; no slash: the CPU.
inline std::pair<std::string, std::string> split_remote_device(const std::string& spec) {
  auto slash = spec.find('/');
  if (slash == std::string::npos) return {spec, "cpu"};
  return {spec.substr(0, slash), spec.substr(slash + 1)};
}
}  // namespace detail

}  // namespace corpc
