// The runtime's private state. Parts that own their state and are used through their own interface:
//   io_threads.hpp        the I/O threads and their executors
//   activity.hpp          calls and handlers in flight, requests per peer; waiting for quiet
//   graceful_shutdown.hpp the rounds in which every worker waits for the job to be quiet before it closes, with rank
//                         0's side (shutdown_rounds.hpp); the background scope's join
//   call_engine.hpp       a connection's calls, both ways: start, reply, deadlines, cancellation; it is the connection's
//                         session, with the rest of what we know of the connection (rpc_session.hpp)
//   frame_dispatcher.hpp  which part each frame goes to (each owner registers its routes: route_frames)
//   request_server.hpp    the peers' requests: lookup, execution (I/O thread or pool), replies and error frames
//   environment.hpp       what the environment adds to the options
//   rendezvous.hpp        Hellos, registrations, the world table, ranks that rejoin; with them the proofs of identity
//                         (hello_proofs.hpp) and the wait for the table (rendezvous_state.hpp)
//   peer_table.hpp        connections by rank, who speaks for each rank, which ranks are gone
//   same_host.hpp         the same-host channel and CUDA IPC per peer: what we offer, set-up, IpcDone frames
//   local_listener.hpp    the abstract Unix socket that peers on this host dial instead of our TCP port
// The rest is shared by the files that implement the runtime:
//   runtime.cpp     public surface, init_rpc
//   calls.cpp       start_call (the connection for a call) and the replies to our calls
//   runtime_hosts.cpp  what the parts use of the runtime (CallHost, RequestHost, RendezvousHost,
//                      LocalListener::Host), framing for a peer both ways
//   device_delivery.cpp  frames whose tensors go to CUDA devices first
//   peers.cpp       connections: dialing, accepting, closing, peer death
//   rendezvous_start.cpp  finding every worker at start: listening, the registration with rank 0
// Threads: I/O threads own connections and timers; the worker pool runs handlers; any thread may call. Fields say
// which lock or thread guards them.
#pragma once

#include <asio.hpp>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "corpc/rpc/detail/registry.hpp"
#include "corpc/rpc/runtime.hpp"

#include "rpc/activity.hpp"
#include "rpc/call_engine.hpp"
#include "rpc/environment.hpp"
#include "rpc/frame_dispatcher.hpp"
#include "rpc/graceful_shutdown.hpp"
#include "rpc/hello.hpp"
#include "rpc/io_threads.hpp"
#include "rpc/local_listener.hpp"
#include "rpc/peer_table.hpp"
#include "rpc/rank_identities.hpp"
#include "rpc/rendezvous.hpp"
#include "rpc/replacement_waits.hpp"
#include "rpc/request_server.hpp"
#include "rpc/same_host.hpp"
#include "transport/auth.hpp"
#include "transport/connection.hpp"
#include "transport/rank_identity.hpp"
#include "transport/refusal_log.hpp"
#include "transport/shm_channel.hpp"

namespace corpc {

struct Runtime::Impl {
  RpcOptions options;
  detail::AuthConfig auth;  // from options.secret / CORPC_SECRET
  // Fixed before the I/O threads start, except self.host of a worker listening on a wildcard address: the world table
  // fills it in (under self_host_mutex) while other I/O threads may be answering Hellos with a copy of self.
  WorkerInfo self;
  mutable std::mutex self_host_mutex;
  int world_size = 0;
  std::vector<WorkerInfo> workers;  // by rank; written once with the world table, before init_rpc returns
  std::unordered_map<std::string, int> rank_by_name;

  // The I/O threads (io_threads.hpp), made by start_threads. The rendezvous frames (Hello, World) are handled on the
  // thread of the connection that carried them, so with several I/O threads two registrations can complete at once:
  // Registrations::take_if_complete publishes once.
  std::unique_ptr<detail::IoThreads> io_threads;
  asio::io_context& main_io() { return io_threads->main(); }
  asio::io_context& pick_io() { return io_threads->pick(); }
  std::optional<asio::ip::tcp::acceptor> acceptor;  // on the main I/O thread; created with the threads
  // Peers on this host connect here rather than to `acceptor` (local_listener.hpp): the same connections over an
  // abstract Unix socket, on the main I/O thread. Not started when it is off (RpcOptions::same_host_socket, TLS);
  // its address is then empty, as when it cannot be bound.
  detail::LocalListener local_listener;
  std::vector<detail::LocalAddress> local_addresses;  // by rank, from the world table (written with `workers`)
  // The same-host channel and CUDA IPC per peer (same_host.hpp); started by rendezvous before any Hello.
  detail::SameHost same_host;
  std::unique_ptr<ThreadPool> pool;

  // The parts that own frames (frame_dispatcher.hpp), made and wired by route_frames before any connection exists;
  // declared before the connections, which use them until they are gone.
  detail::FrameDispatcher frames;
  std::unique_ptr<detail::CallHost> call_host;              // what each connection's call engine uses of this runtime
  std::unique_ptr<detail::RequestHost> request_host;        // what the request side uses of it
  std::unique_ptr<detail::RendezvousHost> rendezvous_host;  // and the rendezvous
  std::unique_ptr<detail::ShutdownHost> shutdown_host;      // and graceful shutdown
  std::unique_ptr<detail::LocalListener::Host> local_host;  // and the same-host listener (not a frame owner)
  std::unique_ptr<detail::RequestServer> requests;          // the peers' requests

  // Connections and the state of every peer (peer_table.hpp); made by init_rpc once the world size is known.
  std::unique_ptr<detail::PeerTable> peers;
  // Calls to dead ranks held for their replacement (RpcOptions::replacement_wait; replacement_waits.hpp).
  detail::ReplacementWaits replacement_waits;
  // Hellos, registrations and the world table (rendezvous.hpp); made by route_frames. After the peer table, which it
  // uses.
  std::unique_ptr<detail::Rendezvous> rendezvous;

  std::atomic<std::uint64_t> accepted{0}, accept_errors{0},
      refused_connections{0};  // diagnostics for rendezvous failures
  // What strangers provoke at will is logged at a bounded rate (after io_threads: its timer runs there).
  detail::RefusalLog refused_handshakes{"accept", "connections refused"};
  // Calls and handlers in flight, and requests per peer (activity.hpp); made by init_rpc once the world size is known.
  std::unique_ptr<detail::Activity> activity;

  std::mutex extensions_mutex;
  std::map<std::type_index, std::shared_ptr<void>> extensions;

  detail::TensorHooks tensor_hooks;  // set by runtime initializers, read-only afterwards
  std::mutex hooks_mutex;            // guards the one below
  std::vector<std::function<void(int, const std::string&)>> failure_listeners;

  // Declared after what its tasks' wake-ups touch; joined by shutdown() before the Impl goes.
  TaskScope background;
  // Graceful shutdown (graceful_shutdown.hpp); made by route_frames. After what it uses: the counts, the peer table,
  // the background scope.
  std::unique_ptr<detail::GracefulShutdown> graceful;

  // The device map used with each rank, in both directions (device_map.hpp), and our CUDA devices that RPC uses;
  // written once with the world table, before init_rpc returns.
  std::vector<DeviceMap> device_maps;
  std::vector<c10::Device> rpc_devices;

  // ---- runtime.cpp ----
  void start_threads();
  void stop_threads();
  void route_frames();
  std::string name_of(int rank) const;

  // ---- flow control and liveness (peers.cpp) ----
  // What peers' requests may hold here (RpcOptions::receive_budget_*, max_requests_held); shared by all connections.
  std::unique_ptr<detail::ReceiveBudget> receive_budget;
  // `dialed`: for a connection we open (its session's RpcSession::outgoing).
  detail::ConnectionSettings connection_settings(bool dialed) const;
  void init_flow_control();  // from options; before any connection exists

  // ---- peers.cpp ----
  std::function<void(const std::shared_ptr<detail::Connection>&, detail::Message&&)> frame_handler();
  std::function<void(const std::shared_ptr<detail::Connection>&, const std::string&)> close_handler();
  std::shared_ptr<detail::Connection> connection_to(int rank);
  void on_close(const std::shared_ptr<detail::Connection>& conn, const std::string& why);
  void mark_dead(int rank, const std::string& why);
  void fail_all_calls(std::exception_ptr error);
  void accept_loop();
  // An accepted socket (TCP, or a Unix one adopted into a TCP socket object: `port` 0): authenticates it, then
  // serves it. `address`: the peer's, as the connection records it.
  void serve_accepted(asio::ip::tcp::socket socket, std::string address, std::uint16_t port);
  // Fails what is in flight, says Goodbye if asked (carrying `failure`, the error this rank stops after: "" for an
  // orderly shutdown), closes every connection and stops the threads.
  void close_everything(bool say_goodbye, const std::string& failure = {});

  // ---- rendezvous_start.cpp ----
  // Where rank 0 listens, and where the program or the environment said so (for messages).
  struct MasterAddress {
    std::string host;
    std::uint16_t port = 0;
    std::string source;  // "init_method", "MASTER_ADDR, MASTER_PORT", ...
  };
  // Listens, registers with rank 0 (or, on rank 0, waits for every registration) and returns once the world table is
  // known; throws why not.
  void start_rendezvous(const MasterAddress& master, int listen_fd);
};

Runtime::Impl& runtime_impl(Runtime& rt) noexcept;

namespace detail {
// start_call (corpc/rpc/detail/outbound.hpp) for the runtime's own calls.
void start_call(Runtime::Impl& rt, OutboundCall&& call) noexcept;
// Starts again the calls held for `rank`'s replacement (RpcOptions::replacement_wait): a new incarnation took it.
void restart_held_calls(Runtime::Impl& rt, int rank);
// What the parts use of the runtime (runtime_hosts.cpp).
std::unique_ptr<CallHost> make_call_host(Runtime::Impl& rt);
std::unique_ptr<RequestHost> make_request_host(Runtime::Impl& rt);
std::unique_ptr<RendezvousHost> make_rendezvous_host(Runtime::Impl& rt);
std::unique_ptr<ShutdownHost> make_shutdown_host(Runtime::Impl& rt);
std::unique_ptr<LocalListener::Host> make_local_listener_host(Runtime::Impl& rt);
// The owners of frames register their routes (frame_dispatcher.hpp), each with one function of this form, called by
// route_frames; the parts' are beside them: route_requests (request_server.hpp), route_rendezvous (rendezvous.hpp),
// route_ipc_done (same_host.hpp).
void route_replies(FrameDispatcher& frames);                             // calls.cpp
void route_goodbye(FrameDispatcher& frames, PeerTable& peers);           // peers.cpp
void route_device_delivery(FrameDispatcher& frames, Runtime::Impl& rt);  // device_delivery.cpp
}  // namespace detail

void validate_worker_name(const std::string& name);

}  // namespace corpc
