// The rendezvous: who speaks for which rank, and the world table. Every Hello comes here, on the I/O thread of the
// connection that carried it, and ends in one of three ways:
//   - an answer to our own dial: proven to come from the rank we dialled (once the table is known), or refused;
//   - a claim (a peer dialed us): checked against the table's keys and names, admitted as the rank's speaker and
//     answered, or refused; one that comes before the table is parked with what follows it (WorldGate);
//   - a registration (rank 0 only): recorded until every rank is there, then the table goes to all (once).
// A rank that rejoined (RpcOptions::rejoin) is admitted in place of its predecessor: by rank 0 as a registration,
// answered with the current table that every other rank also gets (on_world_update), and by the others on its first
// connection. The world table, once in, is handed to the runtime (RendezvousHost::take_world), and the frames parked
// before it go back on their own connection's I/O thread.
// The runtime keeps the listening and the dial to rank 0 (rendezvous_start.cpp); this part keeps the state:
// registrations, the world gate, the proofs of identity, rank 0's device configurations, and the promise init_rpc
// waits on. It reaches the runtime only through RendezvousHost, so tests drive it without sockets.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "corpc/core/future.hpp"
#include "corpc/rpc/worker_info.hpp"
#include "corpc/wire/detail/message.hpp"

#include "rpc/frame_dispatcher.hpp"
#include "rpc/hello.hpp"
#include "rpc/hello_proofs.hpp"
#include "rpc/peer_table.hpp"
#include "rpc/rendezvous_state.hpp"
#include "rpc/same_host.hpp"
#include "transport/refusal_log.hpp"
#include "wire/device_map.hpp"

namespace corpc {
// The first frame on every dialed connection.
detail::Message hello_message(const detail::Hello& hello);
// A plain one, without same-host fields (tests that play a peer by hand, tests/raw_peer.hpp).
detail::Message hello_message(const WorkerInfo& self, int world_size, bool rendezvous, const WireLimits& limits);
}  // namespace corpc

namespace corpc::detail {

// What the rendezvous uses of the runtime; one per runtime, outliving every connection. Tests give it one of their own.
class RendezvousHost {
 public:
  virtual ~RendezvousHost() = default;
  // This worker as it introduces itself now (rank 0 fills in a wildcard listener's host with the table).
  virtual WorkerInfo self() const = 0;
  // Where peers on our host dial us (empty when we take no such connections).
  virtual LocalAddress local_address() const = 0;
  // Worker `rank`'s name once the table is known, else "rank N".
  virtual std::string name_of(int rank) const = 0;
  // The world table is in: the runtime takes the workers and their local addresses, and its device maps from every
  // worker's configuration. Throws what resolving the maps throws (the table is then refused, and init_rpc fails).
  virtual void take_world(std::vector<WorkerInfo> workers, std::vector<LocalAddress> local,
                          const std::vector<DeviceConfig>& configs) = 0;
  // A new incarnation took `rank`: what the runtime counted of its predecessor's requests is forgotten (called under
  // the peer table's lock, before the answer goes out) ...
  virtual void forget_peer(int rank) = 0;
  // ... and, once the predecessor's connections are closed, the calls held for the rank start again.
  virtual void restart_held_calls(int rank) = 0;
  // Acts on a frame that was parked until the table was known, on `conn`'s I/O thread, in the order it came.
  virtual void dispatch(const std::shared_ptr<Connection>& conn, Message&& msg) = 0;
};

class Rendezvous {
 public:
  struct Settings {
    int rank = 0;
    int world_size = 0;
    std::string worker;  // our name, for the log
    WireLimits limits;   // ours, sent with every Hello
    bool rejoin = false;
    std::chrono::milliseconds handshake_timeout{5000};
    std::string device_config;  // ours, encoded: announced when registering
  };
  // `dealt`: what the launcher gave this rank to prove who it is (hello_proofs.hpp).
  Rendezvous(RendezvousHost& host, Settings settings, PeerTable& peers, SameHost& same_host, RankProofs dealt);

  // Its frames (route_rendezvous): every Hello; the world table, from rank 0 on the connection we registered through.
  void on_hello(const std::shared_ptr<Connection>& conn, Message&& msg);
  void on_world(Message&& msg);

  // Rank 0, before it accepts anyone: itself, as the first registration.
  void register_self(WorkerInfo self, LocalAddress local);
  // Rank 0: sends everyone the table once all have registered (a world of one: at once).
  void publish_if_complete();
  // Our Hello: to rank 0 (`registering`), or to `to_rank` on a connection whose handshake `transcript` is, signed as
  // `side`'s.
  Hello our_hello(bool registering, int to_rank = -1, const std::string& transcript = {},
                  HelloSide side = HelloSide::dialer) const;

  // Whether the table is known, and the frames parked until it is.
  WorldGate& world() noexcept { return world_; }
  const WorldGate& world() const noexcept { return world_; }
  // Rank 0's registrations so far (a registrant that leaves before the table is forgotten).
  Registrations& registrations() noexcept { return registrations_; }
  // Set once the table is known; failed if the rendezvous cannot complete. init_rpc waits on it.
  Promise<void>& world_ready() noexcept { return world_ready_; }
  std::string name_of(int rank) const { return host_.name_of(rank); }
  // Which rank we are and each peer is, as proven so far.
  HelloProofs& proofs() noexcept { return proofs_; }

 private:
  using Clock = std::chrono::steady_clock;

  void on_answer(const std::shared_ptr<Connection>& conn, const Hello& hello);
  void on_claim(const std::shared_ptr<Connection>& conn, Hello& hello, Message& msg);
  void on_registration(const std::shared_ptr<Connection>& conn, Hello& hello);
  void on_world_update(Message&& msg);
  // Takes `hello`'s sender as the new incarnation of its rank; `registration`: on rank 0, which also sends it the
  // current table, and retries until `deadline` (default: a handshake timeout from now) while the predecessor's
  // connection is not yet seen closed.
  void admit_rejoined(const std::shared_ptr<Connection>& conn, Hello& hello, Hello& answer, bool registration,
                      std::optional<Clock::time_point> deadline = std::nullopt);
  // The name the table gives `rank`, if it is not `name`: the reason to refuse a Hello that says otherwise.
  std::optional<std::string> misnamed(const WorkerInfo& info) const;
  // Turns a dialer away: an Error frame with id 0 (the connection itself), then close.
  void refuse(const std::shared_ptr<Connection>& conn, const std::string& why);
  // Refuses a Hello that claimed `claimed`, whose rank is taken or whose claim is unproven, and says so in our log.
  void refuse_claim(const std::shared_ptr<Connection>& conn, const WorkerInfo& claimed, const std::string& why);
  // Refuses the answer to our Hello on `conn`, which claimed `claimed` and did not prove it.
  void refuse_answer(const std::shared_ptr<Connection>& conn, const WorkerInfo& claimed, const std::string& why);

  RendezvousHost& host_;
  const Settings settings_;
  PeerTable& peers_;
  SameHost& same_host_;
  HelloProofs proofs_;
  Registrations registrations_;
  WorldGate world_;
  // The table as this part keeps it: for the names Hellos are checked against and the table a rank that rejoins gets
  // (written once by on_world, before the gate opens).
  std::vector<WorkerInfo> workers_;
  std::vector<LocalAddress> local_;
  // Rank 0: every rank's announced device configuration, as published (for ranks that rejoin).
  std::vector<std::string> device_configs_;
  Promise<void> world_ready_;
  // Whoever holds the secret may send Hellos at will: their refusals are logged at a bounded rate.
  RefusalLog refused_hellos_{"hello", "hellos refused"};
};

// The rendezvous's routes: hello, world, and refusal (the peer refused the connection itself).
void route_rendezvous(FrameDispatcher& frames, Rendezvous& rendezvous);

}  // namespace corpc::detail
