/// @file
/// The identity of a worker, and the ways to name one in a call.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "corpc/wire/codec.hpp"

namespace corpc {

struct WorkerInfo {
  std::string name;
  int rank = -1;
  std::string host;        ///< address its listener is reachable at
  std::uint16_t port = 0;  ///< its listener's port
  bool operator==(const WorkerInfo&) const = default;
  CORPC_FIELDS(name, rank, host, port)
};

/// Names a destination by rank, by name, or by WorkerInfo; resolved (and checked) when the call is made.
class WorkerRef {
 public:
  WorkerRef(int rank) : rank_(rank) {}                                    // NOLINT: implicit by design
  WorkerRef(std::string_view name) : name_(name) {}                       // NOLINT
  WorkerRef(const char* name) : name_(name) {}                            // NOLINT
  WorkerRef(const std::string& name) : name_(name) {}                     // NOLINT
  WorkerRef(const WorkerInfo& info) : rank_(info.rank), name_(info.name) {}  // NOLINT
  int rank() const noexcept { return rank_; }
  const std::string& name() const noexcept { return name_; }

 private:
  int rank_ = -1;
  std::string name_;
};

}  // namespace corpc
