// The env:// rendezvous for DDP: a store (see init_process_group's comment for which) and a Gloo group on it.
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "corpc/ddp/ddp.hpp"

namespace corpc::ddp {
namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    if (fallback == nullptr) throw std::runtime_error(std::string("init_process_group: ") + name + " is not set");
    return fallback;
  }
  return v;
}

c10::intrusive_ptr<c10d::Store> make_store(const std::string& addr, int port, int rank, int world,
                                           std::chrono::milliseconds timeout) {
  const bool agent_store = env_or("TORCHELASTIC_USE_AGENT_STORE", "") == "True";
  if (!agent_store && std::getenv("CORPC_SECRET") != nullptr) {
    // corpc::launch_processes: rank 0 holds MASTER_PORT's listening socket for RPC, so no TCPStore can bind it.
    // All ranks are forks of one launcher (same parent, same port): a file named after both is unique to this run.
    auto path = "/tmp/corpc-ddp-store-" + std::to_string(::getppid()) + "-" + std::to_string(port);
    auto store = c10::make_intrusive<c10d::FileStore>(path, world);
    store->setTimeout(timeout);
    return store;
  }
  c10d::TCPStoreOptions o;
  o.port = static_cast<std::uint16_t>(port);
  o.isServer = !agent_store && rank == 0;  // torchrun's agent already serves a store on MASTER_PORT
  o.numWorkers = agent_store ? c10::nullopt : c10::optional<std::size_t>(world);
  o.waitWorkers = false;
  o.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(addr, o);
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options) {
  const int rank = std::stoi(env_or("RANK", nullptr));
  const int world = std::stoi(env_or("WORLD_SIZE", nullptr));
  const std::string addr = env_or("MASTER_ADDR", "127.0.0.1");
  const int port = std::stoi(env_or("MASTER_PORT", "29500"));
  auto store = c10::make_intrusive<c10d::PrefixStore>(options.store_prefix,
                                                      make_store(addr, port, rank, world, options.timeout));
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  const bool loopback = addr == "127.0.0.1" || addr == "localhost";
  gloo_options->devices = {loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                                    : c10d::ProcessGroupGloo::createDefaultDevice()};
  gloo_options->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);
}

}  // namespace corpc::ddp
