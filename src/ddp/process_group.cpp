// The env:// rendezvous for DDP: a store (see init_process_group's comment for which) and a Gloo group on it.
#include "ddp/process_group.hpp"

#include <signal.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <unistd.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "corpc/ddp/ddp.hpp"
#include "corpc/ddp/rpc_store.hpp"
#include "corpc/detail/torch_compat.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

#include "memory/host_allocator.hpp"
#include "rpc/environment.hpp"

namespace corpc::ddp {
namespace {

// A launcher's value (read as init_rpc reads it: torchrun / Slurm / Open MPI / PMI), else RPC's, else an error.
int launcher_or(int from_environment, int fallback, const char* what) {
  if (from_environment >= 0) return from_environment;
  if (fallback >= 0) return fallback;
  throw UsageError(std::string("init_process_group: ") + what +
                   " is not set (nor Slurm's, Open MPI's or PMI's equivalent), and RPC is not running to give it");
}

c10::intrusive_ptr<c10d::Store> make_store(const std::string& addr, int port, int rank, int world,
                                           std::chrono::milliseconds timeout) {
  const bool agent_store = corpc::detail::agent_store_from_environment();
  if (!agent_store && corpc::detail::started_by_corpc_launcher()) {
    // launch_processes or corpcrun: rank 0 holds MASTER_PORT's listening socket for RPC, so no TCPStore can bind it.
    // All ranks are children of one launcher on one host (same parent, same port): a file named after both is unique
    // to this run. Under other launchers (srun, mpirun, torchrun's file rendezvous) rank 0 serves a TCPStore on
    // MASTER_PORT, which reaches ranks on other hosts too (their parents differ: slurmstepd, orted).
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
  corpc::detail::use_classic_tcpstore(o);
  return c10::make_intrusive<c10d::TCPStore>(addr, o);
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(const ProcessGroupOptions& options) {
  Runtime* rpc = Runtime::try_get();
  corpc::detail::configure_host_memory_defaults();  // unless the program or init_rpc did
  // The environment first (a launcher's, or a program presenting a subset of the workers as a world of its own),
  // then RPC's rank and size.
  int rank = options.rank, world = options.world_size;
  if (rank < 0) rank = launcher_or(corpc::detail::rank_from_environment(), rpc ? rpc->rank() : -1, "RANK");
  if (world < 0)
    world = launcher_or(corpc::detail::world_size_from_environment(), rpc ? rpc->world_size() : -1, "WORLD_SIZE");
  if (rank >= world) {
    throw UsageError("init_process_group: rank " + std::to_string(rank) + " is not below the group size " +
                     std::to_string(world));
  }
  // The launcher's variables, read as init_rpc reads them (src/rpc/environment.hpp).
  std::string addr = corpc::detail::master_address_from_environment();
  if (addr.empty()) addr = "127.0.0.1";
  // Groups made one after another in a process (on every rank in the same order, as in PyTorch) get their own keys.
  static std::atomic<int> groups_made{0};
  const std::string prefix = options.store_prefix + std::to_string(groups_made++) + "/";
  c10::intrusive_ptr<c10d::Store> base;
  if (rpc != nullptr) {
    base = c10::make_intrusive<RpcStore>(0, options.timeout);  // one rendezvous: the keys live on RPC's rank 0
  } else {
    const int port = corpc::detail::master_port_from_environment();
    base = make_store(addr, port >= 0 ? port : 29500, rank, world, options.timeout);
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>(prefix, base);
  return detail::gloo_group(store, rank, world, options.timeout,
                            addr == "127.0.0.1" || addr == "localhost" ? std::string("127.0.0.1") : std::string());
}

namespace detail {

void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

c10::intrusive_ptr<c10d::ProcessGroup> gloo_group(c10::intrusive_ptr<c10d::Store> store, int rank, int world,
                                                  std::chrono::milliseconds timeout, const std::string& host) {
  ignore_sigpipe_unless_handled();
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(timeout);
  gloo_options->devices = {host.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                        : c10d::ProcessGroupGloo::createDeviceForHostname(host)};
  gloo_options->threads = 2;
  auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gloo_options);
  return corpc::detail::as_process_group<c10d::ProcessGroup>(std::move(gloo), store, rank, world);
}

std::string rpc_host() { return get_worker_info().host; }

}  // namespace detail

}  // namespace corpc::ddp
