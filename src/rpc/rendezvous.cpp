// Rendezvous: every rank registers with rank 0, which answers with the full table once all are there.
// Ranks may start in any order: the others retry reaching rank 0 until RpcOptions::init_timeout.
#include "corpc/rpc/call.hpp"

#include "core/log.hpp"
#include "memory/cuda_transfer.hpp"
#include "rpc/error_frames.hpp"
#include "rpc/hello.hpp"
#include "rpc/runtime_impl.hpp"
#include "wire/device_map.hpp"

namespace corpc {

namespace {

// The loopback address `host` names (a literal such as 127.0.0.2 or ::1, or a name that resolves only to loopback
// addresses), or empty if it names anything else: a job whose rank 0 is on loopback stays on loopback.
std::string loopback_address_of(asio::io_context& io, const std::string& host) {
  asio::error_code ec;
  auto literal = asio::ip::make_address(host, ec);
  if (!ec) return literal.is_loopback() ? literal.to_string() : std::string();
  asio::ip::tcp::resolver resolver(io);
  auto results = resolver.resolve(host, "", ec);
  if (ec || results.empty()) return {};
  for (const auto& r : results)
    if (!r.endpoint().address().is_loopback()) return {};
  return results.begin()->endpoint().address().to_string();
}

// A rank's registration with rank 0, as init_rpc waits for it: whether a connection was made, and the last reason
// one was not (any thread may ask; the dial runs on the main I/O thread).
class RankZeroDial {
 public:
  void failed(std::string why) {
    std::lock_guard lock(mutex_);
    last_failure_ = std::move(why);
  }
  void connected() {
    std::lock_guard lock(mutex_);
    connected_ = true;
  }
  // What init_rpc says when the world table did not come in time.
  std::string why_not(const Runtime::Impl::MasterAddress& master, std::chrono::milliseconds timeout) const {
    std::lock_guard lock(mutex_);
    const std::string within = " within the init timeout (" + std::to_string(timeout.count()) +
                               " ms: RpcOptions::init_timeout, CORPC_INIT_TIMEOUT_MS)";
    if (connected_) return "init_rpc: workers did not all arrive" + within + " (no answer from rank 0)";
    return "could not reach rank 0 at " + master.host + ":" + std::to_string(master.port) + " (" + master.source + ")" +
           within + (last_failure_.empty() ? "" : ": " + last_failure_);
  }

 private:
  mutable std::mutex mutex_;
  bool connected_ = false;
  std::string last_failure_;
};

// Dials rank 0 until it answers the handshake or `deadline` passes, then sends our registration (a Hello). Rank 0 not
// listening yet is retried every 50 ms; a handshake that stalls, three times in all; a refusal (another secret) ends
// the rendezvous at once.
asio::awaitable<void> register_with_rank_zero(Runtime::Impl& rt, Runtime::Impl::MasterAddress master,
                                              std::chrono::steady_clock::time_point deadline,
                                              std::shared_ptr<RankZeroDial> dial) {
  asio::io_context& io = rt.main_io();
  asio::steady_timer pause(io);
  int interrupted = 0;  // handshakes with rank 0 that stalled or broke off
  for (;;) {
    detail::Transport transport{asio::ip::tcp::socket(io)};
    std::string failure;
    std::string address;  // rank 0's, as connected: the connection need not ask the socket
    try {
      asio::ip::tcp::resolver resolver(io);
      const std::string port = std::to_string(master.port);
      auto endpoints = co_await resolver.async_resolve(master.host, port, asio::use_awaitable);
      auto connected = co_await asio::async_connect(transport.socket(), endpoints, asio::use_awaitable);
      address = connected.address().to_string();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (failure.empty()) {
      std::string refused;
      try {
        co_await detail::authenticate(transport, rt.auth, detail::AuthRole::dialer);
      } catch (const detail::HandshakeInterrupted& e) {
        // A rank 0 too busy to answer within the handshake timeout (or one that gave up on us for that reason) is
        // tried again on a fresh connection: three handshakes in all, as a dial has (tcp_dial.cpp).
        if (++interrupted < 3) failure = e.what();
        else refused = std::string(e.what()) + " (3 attempts)";
      } catch (const std::exception& e) {
        refused = e.what();
      }
      if (!refused.empty()) {  // a different secret does not get better by retrying
        rt.world_ready.set_exception(ConnectionError("rank 0 at " + master.host + ":" + std::to_string(master.port) +
                                                     " refused us: " + refused));
        co_return;
      }
    }
    if (!failure.empty()) {
      dial->failed(failure);
      if (std::chrono::steady_clock::now() >= deadline) {
        rt.world_ready.set_exception(TimeoutError(dial->why_not(master, rt.options.init_timeout)));
        co_return;
      }
      pause.expires_after(std::chrono::milliseconds(50));
      co_await pause.async_wait(asio::use_awaitable);
      continue;
    }
    dial->connected();
    auto conn = detail::make_tcp_connection(std::move(transport), rt.connection_settings(/*dialed=*/true),
                                            rt.frame_handler(), rt.close_handler(), std::move(address));
    conn->peer_rank = 0;
    rt.peers->set_outgoing(0, conn);
    conn->send(detail::prepare(hello_message(rt.our_hello(true))));
    co_return;
  }
}

}  // namespace

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

detail::Hello Runtime::Impl::our_hello(bool registering, int to_rank, const std::string& transcript,
                                       detail::HelloSide side) const {
  detail::Hello h;
  {
    std::lock_guard lock(self_host_mutex);
    h.self = self;
  }
  h.world_size = world_size;
  h.registering = registering;
  // Our limits go with it, so that senders refuse oversized messages themselves instead of losing the connection.
  h.limits = options.limits;
  if (registering) h.devices = own_device_config();  // rank 0 checks every worker's maps against the others'
  h.host = same_host.host_id();
  h.cuda_ipc = same_host.cuda_ipc_offered();
  h.rejoining = options.rejoin;
  h.local = local_listener.address();
  proofs->prove(h, registering, to_rank, transcript, side);
  return h;
}

std::string Runtime::Impl::own_device_config() const {
  detail::DeviceConfig c;
  c.device_count = detail::local_cuda_device_count();
  c.devices = options.devices;
  c.maps = options.device_maps;
  return detail::encode_device_config(c);
}

void Runtime::Impl::rendezvous(const MasterAddress& master, int listen_fd) {
  const std::string& master_host = master.host;
  const std::uint16_t master_port = master.port;
  std::string listen_host = options.listen_address;
  if (listen_host.empty()) {
    listen_host = loopback_address_of(main_io(), master_host);
    if (listen_host.empty()) listen_host = "0.0.0.0";
  }
  if (self.rank == 0 && listen_fd >= 0) {
    // A launcher (corpc::launch_processes) bound the port for us, so no other process can take it in between.
    acceptor->assign(asio::ip::tcp::v4(), listen_fd);
  } else {
    asio::ip::tcp::resolver resolver(main_io());
    auto endpoint = *resolver.resolve(listen_host, std::to_string(self.rank == 0 ? master_port : 0)).begin();
    acceptor->open(endpoint.endpoint().protocol());
    acceptor->set_option(asio::ip::tcp::acceptor::reuse_address(true));
    try {
      acceptor->bind(endpoint);
    } catch (const std::system_error& e) {
      throw ConnectionError("cannot listen on " + listen_host + ":" + std::to_string(endpoint.endpoint().port()) +
                            ": " + e.what());
    }
    acceptor->listen();
  }
  self.port = acceptor->local_endpoint().port();
  // Rank 0 is where everyone found it. The others: the address they listen on if it is a specific one, else the
  // address rank 0 sees them at (filled in there).
  const bool specific = listen_host != "0.0.0.0" && listen_host != "::";
  self.host = self.rank == 0 ? master_host : specific ? listen_host : "";
  // Before our registration: it carries where peers on our host connect to us. With TLS every connection carries it,
  // as the peers expect.
  if (options.same_host_socket && !options.tls) local_listener.start(*local_host, main_io(), self.name);
  if (self.rank == 0) {
    // Registered before accepting anyone: a worker's registration may be processed the moment we accept it.
    registrations.add_own(self, own_device_config(), local_listener.address());
  }
  // From here on the I/O threads may read `self`, and on_world fills in its host: this thread reads only its own copy
  // of the rank.
  const int my_rank = self.rank;
  same_host.start(main_io(), {.channel = options.same_host_channel,
                              .cuda_ipc = options.cuda_ipc,
                              .ring_bytes = options.same_host_ring_bytes,
                              .handshake_timeout = options.handshake_timeout,
                              .secret = auth.secret,
                              .worker = self.name});
  asio::post(main_io(), [this] {
    accept_loop();
    local_listener.accept();
    if (self.rank == 0) publish_world_if_complete();  // a world of one
  });

  const auto deadline = std::chrono::steady_clock::now() + options.init_timeout;
  auto dial = std::make_shared<RankZeroDial>();
  if (my_rank != 0) asio::co_spawn(main_io(), register_with_rank_zero(*this, master, deadline, dial), asio::detached);

  auto ready = world_ready.get_future();
  try {
    ready.wait(options.init_timeout + std::chrono::milliseconds(200));
  } catch (const TimeoutError&) {
    if (my_rank != 0) throw TimeoutError(dial->why_not(master, options.init_timeout));
    throw TimeoutError("init_rpc: workers did not all arrive within " + std::to_string(options.init_timeout.count()) +
                       " ms (missing ranks: " + registrations.missing(world_size) + "; " +
                       std::to_string(accepted.load()) + " connections accepted, " +
                       std::to_string(accept_errors.load()) + " accept errors, " +
                       std::to_string(refused_connections.load()) + " refused by the handshake)");
  }
}

// Turns a dialer away: an Error frame with id 0 (the connection itself), then close. Until it closes, nothing else it
// sends is acted on.
void Runtime::Impl::refuse(const std::shared_ptr<detail::Connection>& conn, const std::string& why) {
  detail::RpcSession::of(*conn).hello_refused = true;
  send_error_frame(*conn, 0, std::make_exception_ptr(ProtocolError(why)), self.name, "rendezvous", /*traced=*/false);
  conn->close_when_flushed();
}

// A Hello for a rank that another connection speaks for: refused, with a line in our log (rate-bounded: whoever holds
// the secret may repeat it at will).
void Runtime::Impl::refuse_claim(const std::shared_ptr<detail::Connection>& conn, const WorkerInfo& claimed,
                                 const std::string& why) {
  refused_hellos.refused(conn->io(), self.name,
                         fmt::format("refused a hello from {} as '{}': {}; its connection is closed",
                                     conn->remote_address, claimed.name, why));
  refuse(conn, why);
}

// An answer to our Hello that does not prove it comes from the rank we dialled: the connection closes before anything
// of ours but the Hello went out; the calls that waited on it fail with the reason. The rank is not marked dead: an
// impostor at its address says nothing of the rank itself.
void Runtime::Impl::refuse_answer(const std::shared_ptr<detail::Connection>& conn, const WorkerInfo& claimed,
                                  const std::string& why) {
  const std::string text = fmt::format("the peer at {} answered as worker '{}' (rank {}) and {}", conn->remote_address,
                                       name_of(claimed.rank), claimed.rank, why);
  refused_hellos.refused(conn->io(), self.name, "refused " + text + "; its connection is closed");
  detail::RpcSession::of(*conn).hello_refused = true;
  conn->close(text);
}

void Runtime::Impl::on_hello(const std::shared_ptr<detail::Connection>& conn, detail::Message&& msg) {
  detail::Hello hello;
  try {
    hello = detail::decode_hello(msg.body.data(), msg.body.size());
  } catch (const ProtocolError& e) {
    return refuse(conn, std::string("malformed hello: ") + e.what());
  }
  WorkerInfo& info = hello.self;
  const int their_world = hello.world_size;
  const bool registering = hello.registering;
  const WireLimits& theirs = hello.limits;
  const bool answer_to_ours = detail::RpcSession::of(*conn).outgoing;
  if (!answer_to_ours && conn->peer_rank >= 0) return conn->close("protocol error: a second hello on one connection");
  if (answer_to_ours) {
    // The answer to our own Hello: who the peer is and what it accepts. Until it arrives we assume our own limits.
    if (info.rank != conn->peer_rank)
      return conn->close("protocol error: hello from rank " + std::to_string(info.rank));
    // A dial to a rank (not the registration with rank 0, which is answered before anyone's key is known) reaches
    // whoever listens at its address now: after the rank died, any process. Nothing of ours follows our Hello until
    // the answer proves, for this connection, that it comes from the rank we dialled.
    if (world.known()) {
      if (auto unproven = proofs->unproven_claim(hello, detail::HelloSide::acceptor, conn->handshake_transcript()))
        return refuse_answer(conn, info, *unproven);
    }
    conn->peer_limits = theirs;
    same_host.dial(conn, hello);
    conn->release_sends();
    return;
  }
  if (their_world != world_size)
    return refuse(conn, "world size " + std::to_string(their_world) + " != " + std::to_string(world_size));
  if (info.rank < 0 || info.rank >= world_size || info.rank == self.rank)
    return refuse(conn, "invalid rank " + std::to_string(info.rank));
  // A registration's answer proves nothing (the registrant knows no key yet); a claim's is signed for this connection,
  // once the world table (our certificate with it) is known.
  auto answer = our_hello(false);
  if (!registering) {
    // A claim is checked against the world table's keys: until we have the table it waits with what follows it.
    if (world.park_if_unknown(conn, msg)) return;
    answer = our_hello(false, info.rank, conn->handshake_transcript(), detail::HelloSide::acceptor);
    // A rank that rejoined says so in every Hello it sends; only the first from its incarnation replaces a
    // predecessor here. A later one (a second connection, or one dialed after this process learnt the incarnation from
    // the world table) is an ordinary claim: taking it as a replacement would close the live connection to the same
    // process, and the calls on it.
    const bool new_incarnation = hello.incarnation > proofs->identities().get(info.rank).incarnation;
    if (auto unproven = proofs->unproven_claim(hello, detail::HelloSide::dialer, conn->handshake_transcript()))
      return refuse_claim(conn, info, *unproven);
    if (world.known() && workers[info.rank].name != info.name)
      return refuse(
          conn, "rank " + std::to_string(info.rank) + " is '" + workers[info.rank].name + "', not '" + info.name + "'");
    if (hello.rejoining && new_incarnation && world.known())
      return admit_rejoined(conn, hello, answer, /*registration=*/false);
    if (auto refusal = peers->claim(info.rank, conn)) return refuse_claim(conn, info, *refusal);
    conn->peer_limits = theirs;
    same_host.offer(conn, hello, answer);
    conn->send(detail::prepare(hello_message(answer)));
    return;
  }
  if (self.rank != 0) return refuse(conn, "registration sent to rank " + std::to_string(self.rank));
  if (world.known() && hello.rejoining) {
    if (workers[info.rank].name != info.name)
      return refuse(
          conn, "rank " + std::to_string(info.rank) + " is '" + workers[info.rank].name + "', not '" + info.name + "'");
    if (auto unproven = proofs->unproven_registration(hello, /*replacing=*/true))
      return refuse_claim(conn, info, *unproven);
    return admit_rejoined(conn, hello, answer, /*registration=*/true);
  }
  if (world.known()) return refuse(conn, "the world is already complete");
  if (auto unproven = proofs->unproven_registration(hello, /*replacing=*/false))
    return refuse_claim(conn, info, *unproven);
  if (info.host.empty()) info.host = conn->remote_address;
  // Admitted as the rank's speaker and answered in the same step as the registration is recorded.
  auto outcome = registrations.add(info, conn, std::move(hello.devices), hello.local, [&] {
    return peers->claim(info.rank, conn, [&] {
      proofs->identities().set(info.rank, {hello.incarnation, hello.public_key});
      conn->peer_limits = theirs;
      same_host.offer(conn, hello, answer);
      conn->send(detail::prepare(hello_message(answer)));
    });
  });
  if (outcome.duplicate_name) {
    // A name two ranks claim is not a claim to turn away but a job that cannot start: the ranks waiting for the
    // world fail at once instead of at their init timeout.
    const auto& duplicate = *outcome.duplicate_name;
    refuse(conn, duplicate);
    for (auto& c : outcome.others) refuse(c, duplicate);
    if (!world_ready.get_future().done()) world_ready.set_exception(UsageError("rendezvous failed: " + duplicate));
    return;
  }
  if (outcome.rank_taken) return refuse(conn, *outcome.rank_taken);
  if (outcome.not_admitted) return refuse_claim(conn, info, *outcome.not_admitted);
  publish_world_if_complete();
}

// A new incarnation of a rank that died (RpcOptions::rejoin) claims it: on rank 0 as its registration (answered with
// the current table), elsewhere on its first connection to us. Either way the rank is alive again here, listens where
// its Hello says, and its predecessor's requests are forgotten.
void Runtime::Impl::admit_rejoined(const std::shared_ptr<detail::Connection>& conn, detail::Hello& hello,
                                   detail::Hello& answer, bool registration,
                                   std::optional<detail::Clock::time_point> deadline) {
  const auto rejoin_deadline = deadline.value_or(detail::Clock::now() + options.handshake_timeout);
  const int rank = hello.self.rank;
  detail::PeerTable::Address at{hello.self.host.empty() ? conn->remote_address : hello.self.host, hello.self.port,
                                hello.local};
  hello.self.host = at.host;
  auto [refusal, old] = peers->revive(rank, conn, at, [&] {
    activity->forget_peer(rank);
    conn->peer_limits = hello.limits;
    same_host.offer(conn, hello, answer);
    conn->send(detail::prepare(hello_message(answer)));
  });
  if (refusal) {
    // On rank 0 the registration waits a little for the predecessor's connection to be seen closing: the launcher
    // restarts a rank once its process is gone, and that close may still be on its way here. The new incarnation
    // sends nothing else before the table, so nothing is read from it meanwhile. A peer's claim is not held up: the
    // new incarnation's calls follow its Hello at once.
    if (registration && detail::Clock::now() < rejoin_deadline) {
      auto pause = std::make_shared<asio::steady_timer>(conn->io(), std::chrono::milliseconds(20));
      pause->async_wait([this, pause, conn, hello, answer, rejoin_deadline](const asio::error_code&) mutable {
        admit_rejoined(conn, hello, answer, true, rejoin_deadline);
      });
      return;
    }
    return refuse_claim(conn, hello.self, *refusal);
  }
  if (old) old->close("worker '" + hello.self.name + "' was replaced by a new incarnation");
  detail::log(detail::LogLevel::info, self.name, "rendezvous", "worker '{}' (rank {}) rejoined from {}:{}",
              hello.self.name, rank, at.host, at.port);
  detail::restart_held_calls(*this, rank);
  if (!registration) return;
  proofs->identities().set(rank, {hello.incarnation, hello.public_key});
  detail::Message table;
  table.head.kind = detail::FrameKind::World;
  Writer w(table.body);
  w.put(peers->current_addresses(workers));
  auto configs = world_device_configs;
  configs[rank] = hello.devices;
  w.put(configs);
  w.put(peers->current_local_addresses(local_addresses));
  w.put(proofs->identities().all());
  // Every other live rank takes the new incarnation's key and addresses from this table at once (on_world_update),
  // so that none dials its predecessor's address, where any process may listen now, or waits to be dialled first.
  detail::Message update = table;
  Writer(update.body).put(std::string());
  for (int r = 1; r < world_size; ++r) {
    if (r == rank) continue;
    if (auto speaker = peers->speaker(r)) {
      detail::Message copy = update;
      speaker->send(detail::prepare(std::move(copy)));
    }
  }
  // What the new incarnation shows its peers that have not taken the update yet: rank 0's word for its key.
  w.put(proofs->certify(rank, hello.incarnation, hello.public_key));
  conn->send(detail::prepare(std::move(table)));
}

// Rank 0, the I/O thread of the last registration: once every rank has registered, sends each the table and takes
// it itself. Two registrations completing at once on two I/O threads both get here; only one publishes.
void Runtime::Impl::publish_world_if_complete() {
  auto complete = registrations.take_if_complete(world_size);
  if (!complete) return;
  detail::Message table;
  table.head.kind = detail::FrameKind::World;
  Writer w(table.body);
  w.put(complete->workers);
  w.put(complete->device_configs);  // every worker checks the job's device maps itself, and reaches the same verdict
  world_device_configs = complete->device_configs;  // a rank that rejoins gets them too
  w.put(complete->local);
  w.put(proofs->identities().all());
  w.put(std::string());  // no certificate: every rank's key is in the table
  for (auto& c : complete->registrants) {
    detail::Message copy = table;
    c->send(detail::prepare(std::move(copy)));
  }
  on_world(std::move(table));
}

namespace {

// A world table as rank 0 sends it (publish_world_if_complete, admit_rejoined).
struct WorldTable {
  std::vector<WorkerInfo> workers;
  std::vector<detail::DeviceConfig> configs;
  std::vector<detail::LocalAddress> locals;
  std::vector<detail::RankIdentity> keys;
  std::string certificate;  // rank 0's for the receiver's incarnation, if it replaced a rank; else empty
};

// Throws ProtocolError if `msg` is malformed or not a table of `world_size` ranks.
WorldTable decode_world(const detail::Message& msg, int world_size) {
  WorldTable t;
  try {
    Reader r(msg.body.data(), msg.body.size());
    t.workers = r.get<std::vector<WorkerInfo>>();
    for (const auto& c : r.get<std::vector<std::string>>()) t.configs.push_back(detail::decode_device_config(c));
    t.locals = r.get<std::vector<detail::LocalAddress>>();
    t.keys = r.get<std::vector<detail::RankIdentity>>();
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

// A table rank 0 sends after the first: a rank was replaced. Each newer incarnation in it is taken, with where it
// listens; whatever this worker held of its predecessor is let go. Nothing else in it changes anything here.
void Runtime::Impl::on_world_update(detail::Message&& msg) {
  if (!world.known()) return;
  WorldTable t;
  try {
    t = decode_world(msg, world_size);
  } catch (const ProtocolError& e) {
    detail::log(detail::LogLevel::warn, self.name, "rendezvous", "ignored an update of the world table: {}", e.what());
    return;
  }
  for (int r = 0; r < world_size; ++r) {
    if (r == self.rank || r == 0 || t.keys[r].public_key.empty()) continue;
    if (t.keys[r].incarnation <= proofs->identities().get(r).incarnation) continue;
    if (!proofs->identities().advance(r, t.keys[r])) continue;
    const auto old = peers->replaced(r, {t.workers[r].host, t.workers[r].port, t.locals[r]});
    activity->forget_peer(r);
    for (const auto& c : old) c->close("worker '" + t.workers[r].name + "' was replaced by a new incarnation");
    detail::log(detail::LogLevel::info, self.name, "rendezvous",
                "worker '{}' (rank {}) was replaced by incarnation {}, at {}:{} (rank 0's word)", t.workers[r].name, r,
                t.keys[r].incarnation, t.workers[r].host, t.workers[r].port);
    detail::restart_held_calls(*this, r);
  }
}

void Runtime::Impl::on_world(detail::Message&& msg) {
  if (!world.first_table()) return on_world_update(std::move(msg));
  WorldTable t;
  try {
    t = decode_world(msg, world_size);
  } catch (const ProtocolError& e) {
    world_ready.set_exception(e);
    return;
  }
  std::vector<WorkerInfo> table = std::move(t.workers);
  std::vector<detail::DeviceConfig> configs = std::move(t.configs);
  std::vector<detail::LocalAddress> locals = std::move(t.locals);
  std::vector<detail::RankIdentity> keys = std::move(t.keys);
  std::string our_certificate = std::move(t.certificate);
  for (int r = 0; r < world_size; ++r) {
    if (table[r].rank != r) return void(world_ready.set_exception(ProtocolError("world table out of order")));
    rank_by_name[table[r].name] = r;
  }
  try {
    std::vector<std::string> names;
    for (const auto& w : table) names.push_back(w.name);
    auto resolved = detail::resolve_device_maps(self.rank, names, configs);
    device_maps = std::move(resolved.by_rank);
    rpc_devices = std::move(resolved.devices);
  } catch (...) {
    world_ready.set_exception(std::current_exception());
    return;
  }
  workers = std::move(table);
  local_addresses = std::move(locals);
  proofs->identities().set_all(std::move(keys));
  proofs->set_certificate(std::move(our_certificate));
  {
    // Only the host can differ (rank 0 fills in the address it saw); the rest of self is read unlocked everywhere.
    std::lock_guard lock(self_host_mutex);
    self.host = workers[self.rank].host;
  }
  // Each connection's parked frames go back on its own I/O thread: the table may complete on another one, and a
  // connection's reader state (its receive credit) belongs to its thread. Taken there, in its order, so that no frame
  // it reads meanwhile overtakes them (WorldGate).
  for (auto& conn : world.open()) {
    asio::post(conn->io(), [this, conn] {
      for (auto& m : world.take(*conn)) frames.dispatch(conn, std::move(m));
    });
  }
  world_ready.set_value();
}

void detail::route_rendezvous(FrameDispatcher& frames, Runtime::Impl& rt) {
  frames.on(Route::hello,
            [&rt](const std::shared_ptr<Connection>& conn, Message&& msg) { rt.on_hello(conn, std::move(msg)); });
  frames.on(Route::world, [&rt](const std::shared_ptr<Connection>& conn, Message&& msg) {
    // Only rank 0 publishes the table, on the connection we registered through.
    if (!RpcSession::of(*conn).outgoing || conn->peer_rank != 0)
      return conn->close("protocol error: a world table not from rank 0");
    rt.on_world(std::move(msg));
  });
  // The peer refused the connection itself (an Error frame with id 0).
  frames.on(Route::refusal, [&rt](const std::shared_ptr<Connection>& conn, Message&& msg) {
    std::string why = "refused by peer";
    try {
      std::rethrow_exception(decode_error(msg, rt.name_of(conn->peer_rank), "rendezvous"));
    } catch (const std::exception& e) {
      why = e.what();
    }
    if (!rt.world_ready.get_future().done()) rt.world_ready.set_exception(RpcError("rendezvous refused: " + why));
    conn->close(why);
  });
}

}  // namespace corpc
