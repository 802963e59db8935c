// The rendezvous part (rendezvous.hpp): Hellos, registrations, the world table and ranks that rejoin.
#include "rpc/rendezvous.hpp"

#include "corpc/rpc/errors.hpp"
#include "corpc/wire/codec.hpp"

#include "core/log.hpp"
#include "rpc/error_frames.hpp"
#include "rpc/rpc_session.hpp"

namespace corpc {

detail::Message hello_message(const detail::Hello& hello) {
  detail::Message m;
  m.head.kind = detail::FrameKind::Hello;
  m.body = detail::encode_hello(hello);
  return m;
}

detail::Message hello_message(const WorkerInfo& self, int world_size, bool rendezvous, const WireLimits& limits) {
  return hello_message(detail::Hello{
      detail::kProtocolVersion, self, world_size, rendezvous, limits, {}, {}, {}, {}, false, false, {}, 0, {}, {}, {}});
}

}  // namespace corpc

namespace corpc::detail {

namespace {

// A world table as rank 0 sends it (publish_if_complete, admit_rejoined).
struct WorldTable {
  std::vector<WorkerInfo> workers;
  std::vector<DeviceConfig> configs;
  std::vector<LocalAddress> locals;
  std::vector<RankIdentity> keys;
  std::string certificate;  // rank 0's for the receiver's incarnation, if it replaced a rank; else empty
};

// Throws ProtocolError if `msg` is malformed or not a table of `world_size` ranks.
WorldTable decode_world(const Message& msg, int world_size) {
  WorldTable t;
  try {
    Reader r(msg.body.data(), msg.body.size());
    t.workers = r.get<std::vector<WorkerInfo>>();
    for (const auto& c : r.get<std::vector<std::string>>()) t.configs.push_back(decode_device_config(c));
    t.locals = r.get<std::vector<LocalAddress>>();
    t.keys = r.get<std::vector<RankIdentity>>();
    t.certificate = r.get<std::string>();
  } catch (const ProtocolError& e) {
    throw ProtocolError(std::string("malformed world table: ") + e.what());
  }
  if (static_cast<int>(t.workers.size()) != world_size || static_cast<int>(t.configs.size()) != world_size ||
      static_cast<int>(t.locals.size()) != world_size || static_cast<int>(t.keys.size()) != world_size)
    throw ProtocolError("world table of the wrong size");
  return t;
}

}  // namespace

Rendezvous::Rendezvous(RendezvousHost& host, Settings settings, PeerTable& peers, SameHost& same_host, RankProofs dealt)
    : host_(host),
      settings_(std::move(settings)),
      peers_(peers),
      same_host_(same_host),
      proofs_(settings_.rank, settings_.world_size, std::move(dealt)) {}

Hello Rendezvous::our_hello(bool registering, int to_rank, const std::string& transcript, HelloSide side) const {
  Hello h;
  h.self = host_.self();
  h.world_size = settings_.world_size;
  h.registering = registering;
  // Our limits go with it, so that senders refuse oversized messages themselves instead of losing the connection.
  h.limits = settings_.limits;
  if (registering) h.devices = settings_.device_config;  // rank 0 checks every worker's maps against the others'
  h.host = same_host_.host_id();
  h.cuda_ipc = same_host_.cuda_ipc_offered();
  h.rejoining = settings_.rejoin;
  h.local = host_.local_address();
  proofs_.prove(h, registering, to_rank, transcript, side);
  return h;
}

void Rendezvous::register_self(WorkerInfo self, LocalAddress local) {
  registrations_.add_own(std::move(self), settings_.device_config, std::move(local));
}

// ---- refusals -------------------------------------------------------------------------------------------------------

// Until it closes, nothing else the dialer sends is acted on.
void Rendezvous::refuse(const std::shared_ptr<Connection>& conn, const std::string& why) {
  RpcSession::of(*conn).hello_refused = true;
  send_error_frame(*conn, 0, std::make_exception_ptr(ProtocolError(why)), settings_.worker, "rendezvous",
                   /*traced=*/false);
  conn->close_when_flushed();
}

// Rate-bounded: whoever holds the secret may repeat it at will.
void Rendezvous::refuse_claim(const std::shared_ptr<Connection>& conn, const WorkerInfo& claimed,
                              const std::string& why) {
  refused_hellos_.refused(conn->io(), settings_.worker,
                          fmt::format("refused a hello from {} as '{}': {}; its connection is closed",
                                      conn->remote_address, claimed.name, why));
  refuse(conn, why);
}

// The connection closes before anything of ours but the Hello went out; the calls that waited on it fail with the
// reason. The rank is not marked dead: an impostor at its address says nothing of the rank itself.
void Rendezvous::refuse_answer(const std::shared_ptr<Connection>& conn, const WorkerInfo& claimed,
                               const std::string& why) {
  const std::string text = fmt::format("the peer at {} answered as worker '{}' (rank {}) and {}", conn->remote_address,
                                       host_.name_of(claimed.rank), claimed.rank, why);
  refused_hellos_.refused(conn->io(), settings_.worker, "refused " + text + "; its connection is closed");
  RpcSession::of(*conn).hello_refused = true;
  conn->close(text);
}

std::optional<std::string> Rendezvous::misnamed(const WorkerInfo& info) const {
  if (workers_[info.rank].name == info.name) return std::nullopt;
  return "rank " + std::to_string(info.rank) + " is '" + workers_[info.rank].name + "', not '" + info.name + "'";
}

// ---- Hellos ---------------------------------------------------------------------------------------------------------

void Rendezvous::on_hello(const std::shared_ptr<Connection>& conn, Message&& msg) {
  Hello hello;
  try {
    hello = decode_hello(msg.body.data(), msg.body.size());
  } catch (const ProtocolError& e) {
    return refuse(conn, std::string("malformed hello: ") + e.what());
  }
  const bool answer_to_ours = RpcSession::of(*conn).outgoing;
  if (!answer_to_ours && conn->peer_rank >= 0) return conn->close("protocol error: a second hello on one connection");
  if (answer_to_ours) return on_answer(conn, hello);
  const WorkerInfo& info = hello.self;
  if (hello.world_size != settings_.world_size)
    return refuse(conn,
                  "world size " + std::to_string(hello.world_size) + " != " + std::to_string(settings_.world_size));
  if (info.rank < 0 || info.rank >= settings_.world_size || info.rank == settings_.rank)
    return refuse(conn, "invalid rank " + std::to_string(info.rank));
  if (!hello.registering) return on_claim(conn, hello, msg);
  if (settings_.rank != 0) return refuse(conn, "registration sent to rank " + std::to_string(settings_.rank));
  on_registration(conn, hello);
}

// The answer to our own Hello: who the peer is and what it accepts. Until it arrives we assume our own limits.
void Rendezvous::on_answer(const std::shared_ptr<Connection>& conn, const Hello& hello) {
  if (hello.self.rank != conn->peer_rank)
    return conn->close("protocol error: hello from rank " + std::to_string(hello.self.rank));
  // A dial to a rank (not the registration with rank 0, which is answered before anyone's key is known) reaches
  // whoever listens at its address now: after the rank died, any process. Nothing of ours follows our Hello until
  // the answer proves, for this connection, that it comes from the rank we dialled.
  if (world_.known()) {
    if (auto unproven = proofs_.unproven_claim(hello, HelloSide::acceptor, conn->handshake_transcript()))
      return refuse_answer(conn, hello.self, *unproven);
  }
  conn->peer_limits = hello.limits;
  same_host_.dial(conn, hello);
  conn->release_sends();
}

// A peer dialed us and claims its rank. Its answer is signed for this connection, once the world table (our
// certificate with it) is known.
void Rendezvous::on_claim(const std::shared_ptr<Connection>& conn, Hello& hello, Message& msg) {
  // A claim is checked against the world table's keys: until we have the table it waits with what follows it.
  if (world_.park_if_unknown(conn, msg)) return;
  const WorkerInfo& info = hello.self;
  auto answer = our_hello(false, info.rank, conn->handshake_transcript(), HelloSide::acceptor);
  // A rank that rejoined says so in every Hello it sends; only the first from its incarnation replaces a
  // predecessor here. A later one (a second connection, or one dialed after this process learnt the incarnation from
  // the world table) is an ordinary claim: taking it as a replacement would close the live connection to the same
  // process, and the calls on it.
  const bool new_incarnation = hello.incarnation > proofs_.identities().get(info.rank).incarnation;
  if (auto unproven = proofs_.unproven_claim(hello, HelloSide::dialer, conn->handshake_transcript()))
    return refuse_claim(conn, info, *unproven);
  if (auto wrong = misnamed(info)) return refuse(conn, *wrong);
  if (hello.rejoining && new_incarnation) return admit_rejoined(conn, hello, answer, /*registration=*/false);
  if (auto refusal = peers_.claim(info.rank, conn)) return refuse_claim(conn, info, *refusal);
  conn->peer_limits = hello.limits;
  same_host_.offer(conn, hello, answer);
  conn->send(prepare(hello_message(answer)));
}

// Rank 0: a rank registers (its answer proves nothing: the registrant knows no key yet), or, once the world is
// complete, a new incarnation of a rank that died registers in its place.
void Rendezvous::on_registration(const std::shared_ptr<Connection>& conn, Hello& hello) {
  WorkerInfo& info = hello.self;
  auto answer = our_hello(false);
  if (world_.known() && hello.rejoining) {
    if (auto wrong = misnamed(info)) return refuse(conn, *wrong);
    if (auto unproven = proofs_.unproven_registration(hello, /*replacing=*/true))
      return refuse_claim(conn, info, *unproven);
    return admit_rejoined(conn, hello, answer, /*registration=*/true);
  }
  if (world_.known()) return refuse(conn, "the world is already complete");
  if (auto unproven = proofs_.unproven_registration(hello, /*replacing=*/false))
    return refuse_claim(conn, info, *unproven);
  if (info.host.empty()) info.host = conn->remote_address;
  // Admitted as the rank's speaker and answered in the same step as the registration is recorded.
  auto outcome = registrations_.add(info, conn, std::move(hello.devices), hello.local, [&] {
    return peers_.claim(info.rank, conn, [&] {
      proofs_.identities().set(info.rank, {hello.incarnation, hello.public_key});
      conn->peer_limits = hello.limits;
      same_host_.offer(conn, hello, answer);
      conn->send(prepare(hello_message(answer)));
    });
  });
  if (outcome.duplicate_name) {
    // A name two ranks claim is not a claim to turn away but a job that cannot start: the ranks waiting for the
    // world fail at once instead of at their init timeout.
    const auto& duplicate = *outcome.duplicate_name;
    refuse(conn, duplicate);
    for (auto& c : outcome.others) refuse(c, duplicate);
    if (!world_ready_.get_future().done()) world_ready_.set_exception(UsageError("rendezvous failed: " + duplicate));
    return;
  }
  if (outcome.rank_taken) return refuse(conn, *outcome.rank_taken);
  if (outcome.not_admitted) return refuse_claim(conn, info, *outcome.not_admitted);
  publish_if_complete();
}

// ---- ranks that rejoin ----------------------------------------------------------------------------------------------

// On rank 0 as its registration (answered with the current table), elsewhere on its first connection to us. Either
// way the rank is alive again here, listens where its Hello says, and its predecessor's requests are forgotten.
void Rendezvous::admit_rejoined(const std::shared_ptr<Connection>& conn, Hello& hello, Hello& answer, bool registration,
                                std::optional<Clock::time_point> deadline) {
  const auto rejoin_deadline = deadline.value_or(Clock::now() + settings_.handshake_timeout);
  const int rank = hello.self.rank;
  PeerTable::Address at{hello.self.host.empty() ? conn->remote_address : hello.self.host, hello.self.port, hello.local};
  hello.self.host = at.host;
  auto [refusal, old] = peers_.revive(rank, conn, at, [&] {
    host_.forget_peer(rank);
    conn->peer_limits = hello.limits;
    same_host_.offer(conn, hello, answer);
    conn->send(prepare(hello_message(answer)));
  });
  if (refusal) {
    // On rank 0 the registration waits a little for the predecessor's connection to be seen closing: the launcher
    // restarts a rank once its process is gone, and that close may still be on its way here. The new incarnation
    // sends nothing else before the table, so nothing is read from it meanwhile. A peer's claim is not held up: the
    // new incarnation's calls follow its Hello at once.
    if (registration && Clock::now() < rejoin_deadline) {
      auto pause = std::make_shared<asio::steady_timer>(conn->io(), std::chrono::milliseconds(20));
      pause->async_wait([this, pause, conn, hello, answer, rejoin_deadline](const asio::error_code&) mutable {
        admit_rejoined(conn, hello, answer, true, rejoin_deadline);
      });
      return;
    }
    return refuse_claim(conn, hello.self, *refusal);
  }
  if (old) old->close("worker '" + hello.self.name + "' was replaced by a new incarnation");
  log(LogLevel::info, settings_.worker, "rendezvous", "worker '{}' (rank {}) rejoined from {}:{}", hello.self.name,
      rank, at.host, at.port);
  host_.restart_held_calls(rank);
  if (!registration) return;
  proofs_.identities().set(rank, {hello.incarnation, hello.public_key});
  Message table;
  table.head.kind = FrameKind::World;
  Writer w(table.body);
  w.put(peers_.current_addresses(workers_));
  auto configs = device_configs_;
  configs[rank] = hello.devices;
  w.put(configs);
  w.put(peers_.current_local_addresses(local_));
  w.put(proofs_.identities().all());
  // Every other live rank takes the new incarnation's key and addresses from this table at once (on_world_update),
  // so that none dials its predecessor's address, where any process may listen now, or waits to be dialled first.
  Message update = table;
  Writer(update.body).put(std::string());
  for (int r = 1; r < settings_.world_size; ++r) {
    if (r == rank) continue;
    if (auto speaker = peers_.speaker(r)) {
      Message copy = update;
      speaker->send(prepare(std::move(copy)));
    }
  }
  // What the new incarnation shows its peers that have not taken the update yet: rank 0's word for its key.
  w.put(proofs_.certify(rank, hello.incarnation, hello.public_key));
  conn->send(prepare(std::move(table)));
}

// ---- the world table ------------------------------------------------------------------------------------------------

// Rank 0, the I/O thread of the last registration: once every rank has registered, sends each the table and takes
// it itself. Two registrations completing at once on two I/O threads both get here; only one publishes.
void Rendezvous::publish_if_complete() {
  auto complete = registrations_.take_if_complete(settings_.world_size);
  if (!complete) return;
  Message table;
  table.head.kind = FrameKind::World;
  Writer w(table.body);
  w.put(complete->workers);
  w.put(complete->device_configs);  // every worker checks the job's device maps itself, and reaches the same verdict
  device_configs_ = complete->device_configs;  // a rank that rejoins gets them too
  w.put(complete->local);
  w.put(proofs_.identities().all());
  w.put(std::string());  // no certificate: every rank's key is in the table
  for (auto& c : complete->registrants) {
    Message copy = table;
    c->send(prepare(std::move(copy)));
  }
  on_world(std::move(table));
}

// A table rank 0 sends after the first: a rank was replaced. Each newer incarnation in it is taken, with where it
// listens; whatever this worker held of its predecessor is let go. Nothing else in it changes anything here.
void Rendezvous::on_world_update(Message&& msg) {
  if (!world_.known()) return;
  WorldTable t;
  try {
    t = decode_world(msg, settings_.world_size);
  } catch (const ProtocolError& e) {
    log(LogLevel::warn, settings_.worker, "rendezvous", "ignored an update of the world table: {}", e.what());
    return;
  }
  for (int r = 0; r < settings_.world_size; ++r) {
    if (r == settings_.rank || r == 0 || t.keys[r].public_key.empty()) continue;
    if (t.keys[r].incarnation <= proofs_.identities().get(r).incarnation) continue;
    if (!proofs_.identities().advance(r, t.keys[r])) continue;
    const auto old = peers_.replaced(r, {t.workers[r].host, t.workers[r].port, t.locals[r]});
    host_.forget_peer(r);
    for (const auto& c : old) c->close("worker '" + t.workers[r].name + "' was replaced by a new incarnation");
    log(LogLevel::info, settings_.worker, "rendezvous",
        "worker '{}' (rank {}) was replaced by incarnation {}, at {}:{} (rank 0's word)", t.workers[r].name, r,
        t.keys[r].incarnation, t.workers[r].host, t.workers[r].port);
    host_.restart_held_calls(r);
  }
}

void Rendezvous::on_world(Message&& msg) {
  if (!world_.first_table()) return on_world_update(std::move(msg));
  WorldTable t;
  try {
    t = decode_world(msg, settings_.world_size);
    for (int r = 0; r < settings_.world_size; ++r)
      if (t.workers[r].rank != r) throw ProtocolError("world table out of order");
    workers_ = t.workers;
    local_ = t.locals;
    host_.take_world(std::move(t.workers), std::move(t.locals), t.configs);
  } catch (...) {
    world_ready_.set_exception(std::current_exception());
    return;
  }
  proofs_.identities().set_all(std::move(t.keys));
  proofs_.set_certificate(std::move(t.certificate));
  // Each connection's parked frames go back on its own I/O thread: the table may complete on another one, and a
  // connection's reader state (its receive credit) belongs to its thread. Taken there, in its order, so that no frame
  // it reads meanwhile overtakes them (WorldGate).
  for (auto& conn : world_.open()) {
    asio::post(conn->io(), [this, conn] {
      for (auto& m : world_.take(*conn)) host_.dispatch(conn, std::move(m));
    });
  }
  world_ready_.set_value();
}

void route_rendezvous(FrameDispatcher& frames, Rendezvous& rendezvous) {
  frames.on(Route::hello, [&rendezvous](const std::shared_ptr<Connection>& conn, Message&& msg) {
    rendezvous.on_hello(conn, std::move(msg));
  });
  frames.on(Route::world, [&rendezvous](const std::shared_ptr<Connection>& conn, Message&& msg) {
    // Only rank 0 publishes the table, on the connection we registered through.
    if (!RpcSession::of(*conn).outgoing || conn->peer_rank != 0)
      return conn->close("protocol error: a world table not from rank 0");
    rendezvous.on_world(std::move(msg));
  });
  // The peer refused the connection itself (an Error frame with id 0).
  frames.on(Route::refusal, [&rendezvous](const std::shared_ptr<Connection>& conn, Message&& msg) {
    std::string why = "refused by peer";
    try {
      std::rethrow_exception(decode_error(msg, rendezvous.name_of(conn->peer_rank), "rendezvous"));
    } catch (const std::exception& e) {
      why = e.what();
    }
    auto& ready = rendezvous.world_ready();
    if (!ready.get_future().done()) ready.set_exception(RpcError("rendezvous refused: " + why));
    conn->close(why);
  });
}

}  // namespace corpc::detail
