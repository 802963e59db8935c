// The Hello frame's body: the first thing a dialer says after authenticating (who it is, the world it expects, and the
// limits it accepts), and the acceptor's answer. Torch-free, so that it is fuzzed on its own (tests/fuzz/).
#pragma once

#include <cstddef>
#include <string>

#include "corpc/rpc/worker_info.hpp"
#include "corpc/wire/detail/frame.hpp"

namespace corpc::detail {

// Where a worker takes connections from peers on its host (src/rpc/local_listener.cpp): its host's identity (boot id
// and network namespace, as the same-host channel reads them) and the name of its abstract Unix socket, without the
// leading NUL. Empty: TCP only.
struct LocalAddress {
  std::string host;
  std::string socket;
  bool operator==(const LocalAddress&) const = default;
  CORPC_FIELDS(host, socket)
};

struct Hello {
  std::uint32_t version = kProtocolVersion;
  WorkerInfo self;
  int world_size = 0;
  bool registering = false;  // a rendezvous registration (to rank 0), not a lazy dial
  WireLimits limits;         // what the sender accepts
  std::string devices;       // registrations: the sender's encoded DeviceConfig (src/wire/device_map.hpp); empty: none
  // The same-host channel (src/transport/shm_channel.hpp): the sender's host identity (empty: it wants no channel); in the
  // acceptor's answer, when it offers one, the name of its Unix socket and the cookie that claims the offer.
  std::string host;
  std::string shm_socket;
  std::string shm_cookie;
  // CUDA IPC (src/memory/cuda_ipc.hpp): the sender can lend and borrow CUDA tensors, should the same-host channel be set up.
  bool cuda_ipc = false;
  // The sender replaces a rank that died in a running world (RpcOptions::rejoin): its registration is taken although
  // the world is complete, and a peer that saw the rank die takes its Hello as the rank's new incarnation.
  bool rejoining = false;
  // Where the sender takes connections from its own host: rank 0 publishes it in the world table, and a peer takes
  // a new incarnation's (rejoining) from its Hello.
  LocalAddress local;
  // Which process of the rank this is (src/transport/rank_identity.hpp): its incarnation (0, then one more per restart
  // by the launcher) and its public key. `proof`: in a registration, the proof of the launcher's credential for this
  // rank and incarnation (empty without one); in a dialer's Hello, its signature over hello_statement(); empty in an
  // answer. `certificate`: rank 0's signature over this incarnation and key, for an incarnation admitted after the
  // world was published (its peers know the earlier one).
  std::uint32_t incarnation = 0;
  std::string public_key;
  std::string proof;
  std::string certificate;
};

std::string encode_hello(const Hello& hello);
// Throws ProtocolError if malformed or if the version is not ours (checked first: a newer peer's layout may differ).
Hello decode_hello(const char* body, std::size_t size);

}  // namespace corpc::detail
