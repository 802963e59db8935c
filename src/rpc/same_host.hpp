// The same-host channel and CUDA IPC per peer (src/transport/shm_channel.hpp and src/memory/cuda_ipc.hpp have the
// mechanisms): whether this process offers them, its side of the Hello exchange that agrees to them (the acceptor
// offers, the dialer sets up), and the IpcDone frames that return CUDA IPC loans. Offered, never assumed, and never
// in the way: until a channel is set up, and whenever it cannot be, the connection carries everything on TCP.
// It needs nothing of the runtime but fixed settings; started before any Hello. Threads: start and close on the
// main I/O thread's side of set-up and shutdown; offer and dial on the I/O thread of the connection whose Hello it is.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "rpc/frame_dispatcher.hpp"
#include "rpc/hello.hpp"
#include "transport/connection.hpp"

namespace corpc::detail {

class CudaIpcLink;
struct CudaIpcArrivals;
class ShmListener;

class SameHost {
 public:
  struct Settings {
    bool channel = false;                            // RpcOptions::same_host_channel
    bool cuda_ipc = false;                           // RpcOptions::cuda_ipc (offered only where the process can)
    std::uint64_t ring_bytes = 0;                    // RpcOptions::same_host_ring_bytes
    std::chrono::milliseconds handshake_timeout{0};  // a dialed channel's set-up, at most
    std::string secret;                              // binds a channel's claim to its connection (channel_claim)
    std::string worker;                              // our name, for the log
  };
  SameHost();
  ~SameHost();

  // Takes `settings`; if the channel is on, learns this host's identity, decides on CUDA IPC, and listens for the
  // channels peers dial to us on `io` (without a listener, only the connections others dial to us stay on TCP).
  // Once, before any Hello.
  void start(asio::io_context& io, Settings settings);
  // What our Hello announces: this host's identity ("": the channel is off) and whether we offer CUDA IPC.
  const std::string& host_id() const noexcept { return host_id_; }
  bool cuda_ipc_offered() const noexcept { return cuda_ipc_offered_; }
  // The name of the abstract Unix socket our channels are set up on ("": none), as `ss -xlp` shows it.
  std::string socket_name() const;

  // Acceptor: a peer on our host (`theirs`, its Hello) gets, in `answer`, the name of our Unix socket and a cookie.
  void offer(const std::shared_ptr<Connection>& conn, const Hello& theirs, Hello& answer);
  // Dialer: the peer's `answer` offered a channel from our host: it is set up on `conn`'s I/O thread, at once with
  // CUDA IPC agreed, else when the first large message crosses the connection.
  void dial(const std::shared_ptr<Connection>& conn, const Hello& answer);
  // Stops listening (shutdown), on the listener's thread.
  void close();

 private:
  void failed(int rank, const std::string& why);
  // The CUDA IPC link for a connection to `rank` whose Hellos agreed to it (null otherwise).
  std::shared_ptr<CudaIpcLink> cuda_ipc_link(int rank, bool theirs, const std::string& their_host);
  void cuda_ipc_failed(int rank, const std::string& why);

  Settings settings_;  // written by start, read-only afterwards, as are the two below
  std::string host_id_;
  bool cuda_ipc_offered_ = false;
  std::unique_ptr<ShmListener> listener_;
  std::atomic<bool> warned_{false}, cuda_ipc_warned_{false};  // a failure was logged at warn already
};

// Makes the IpcDone frames' owner: the peer is done with tensors we lent it.
void route_ipc_done(FrameDispatcher& frames);
// Tells the lender of a message's CUDA IPC tensors (`arrivals`, on `conn`) that their copies are done.
void return_ipc_loans(const std::shared_ptr<Connection>& conn, const CudaIpcArrivals& arrivals);

}  // namespace corpc::detail
