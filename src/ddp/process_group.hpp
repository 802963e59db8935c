// A Gloo group on a given store, shared by init_process_group and the fault-tolerant trainer's groups per epoch.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace corpc::ddp::detail {

// Gloo writes to its peers' sockets without MSG_NOSIGNAL: a member that dies mid-collective would take the survivors
// down with SIGPIPE instead of the collective's error (Python ignores SIGPIPE from the start; a C++ program does not).
// So SIGPIPE is set to ignored, unless the program installed a handler of its own, which is left alone.
void ignore_sigpipe_unless_handled();

// `rank` of a group of `world` that meets through `store` (whose keys must be this group's alone). Gloo listens on
// `host`'s interface (a job on 127.0.0.1 stays there); empty: Gloo's default device, the host name's interface.
// Calls ignore_sigpipe_unless_handled() first.
c10::intrusive_ptr<c10d::ProcessGroup> gloo_group(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                                  std::chrono::milliseconds timeout, const std::string& host);

// Where this worker's Gloo groups listen in a job that runs RPC: the address its RPC listener is reachable at, which
// every peer already reaches (127.0.0.1 on one host, the node's address across hosts).
std::string rpc_host();

}  // namespace corpc::ddp::detail
