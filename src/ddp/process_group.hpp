// A Gloo group on a given store, shared by init_process_group and the fault-tolerant trainer's groups per epoch.
#pragma once

#include <chrono>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace corpc::ddp::detail {

// `rank` of a group of `world` that meets through `store` (whose keys must be this group's alone). `loopback`: the
// job runs on 127.0.0.1, so Gloo's connections stay there (its default device is the host name's interface).
c10::intrusive_ptr<c10d::ProcessGroup> gloo_group(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                                  std::chrono::milliseconds timeout, bool loopback);

}  // namespace corpc::ddp::detail
