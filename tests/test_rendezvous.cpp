// The rendezvous (src/rpc/rendezvous.hpp) on its own, without sockets or workers: connections that record what is sent
// play the wire, a host of the test's plays the runtime (it records the table it is given, the ranks replaced and the
// frames handed back to it), and the peers' Hellos are made and signed with HelloProofs of their own, as their
// runtimes would. What is checked is what a peer would see: the answer, the table, or an error frame whose text says
// why, and what the runtime is told.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "corpc/wire/codec.hpp"

#include "../src/rpc/call_engine.hpp"
#include "../src/rpc/error_frames.hpp"
#include "../src/rpc/rendezvous.hpp"
#include "../src/rpc/rpc_session.hpp"
#include "../src/transport/auth.hpp"
#include "../src/transport/rank_identity.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_rendezvous {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using corpc::test::TableConnection;

namespace {

std::string name(int rank) { return "worker" + std::to_string(rank); }

// The runtime as the rendezvous (and each connection's call engine) sees it.
class TestHost final : public RendezvousHost, public CallHost {
 public:
  explicit TestHost(int rank) : rank_(rank) {}

  // RendezvousHost: records what it is told.
  WorkerInfo self() const override {
    return {name(rank_), rank_, "10.0.0.1", static_cast<std::uint16_t>(9000 + rank_)};
  }
  LocalAddress local_address() const override { return {}; }
  std::string name_of(int rank) const override { return name(rank); }
  void take_world(std::vector<WorkerInfo> workers, std::vector<LocalAddress>,
                  const std::vector<DeviceConfig>&) override {
    tables.push_back(std::move(workers));
  }
  void forget_peer(int rank) override { forgotten.push_back(rank); }
  void restart_held_calls(int rank) override { restarted.push_back(rank); }
  void dispatch(const std::shared_ptr<Connection>& conn, Message&& msg) override {
    dispatched.push_back({std::this_thread::get_id(), msg.head.kind});
    if (on_dispatch) on_dispatch(conn, std::move(msg));
  }

  // CallHost: only what making a connection's session needs.
  OutFrame frame_for(Message&& m, int, Connection&) override { return prepare(std::move(m)); }
  void received_tensors(const FrameHeader&, int, std::vector<at::Tensor>&) override {}
  void arm_cancel(CancelSlot&, Connection&, std::uint64_t) override {}
  Activity& activity() override { return activity_; }
  std::chrono::milliseconds default_timeout() const override { return std::chrono::seconds(60); }

  std::vector<std::vector<WorkerInfo>> tables;
  std::vector<int> forgotten, restarted;
  struct Dispatched {
    std::thread::id thread;
    FrameKind kind;
  };
  std::vector<Dispatched> dispatched;
  std::function<void(const std::shared_ptr<Connection>&, Message&&)> on_dispatch;

 private:
  int rank_;
  Activity activity_{3};
};

// Rank `rank` of a world of 3, its rendezvous, and the connections peers open to it.
struct Worker {
  asio::io_context io;  // first: the connections' timers and sockets go before it
  TestHost host;
  PeerTable peers{3};
  SameHost same_host;  // not started: it offers no channel
  Rendezvous rendezvous;

  explicit Worker(int rank, RankProofs dealt = {}, std::chrono::milliseconds handshake_timeout = {})
      : host(rank),
        rendezvous(host,
                   {.rank = rank,
                    .world_size = 3,
                    .worker = name(rank),
                    .limits = {},
                    .rejoin = false,
                    .handshake_timeout = handshake_timeout,
                    .device_config = encode_device_config({})},
                   peers, same_host, std::move(dealt)) {
    if (rank == 0) rendezvous.register_self(host.self(), {});
  }

  // A connection a peer dialed to us (accepted), or one we dialed to `rank` (its answer comes back on it).
  std::shared_ptr<TableConnection> accepted(asio::io_context* on = nullptr) {
    return std::make_shared<TableConnection>(on ? *on : io, "10.0.0.9", CallEngine::factory(host, 64, false));
  }
  std::shared_ptr<TableConnection> dialed(int rank) {
    auto c = std::make_shared<TableConnection>(io, "10.0.0.9", CallEngine::factory(host, 64, true));
    c->peer_rank = rank;
    return c;
  }
};

// Worker `rank`'s Hello as its own runtime makes it (signed with `proofs` for `conn` when it claims its rank to `to`).
Hello hello_of(int rank, const HelloProofs& proofs, bool registering, int to = -1, const Connection* conn = nullptr) {
  Hello h;
  h.self = {name(rank), rank, "10.0.0.2", static_cast<std::uint16_t>(9000 + rank)};
  h.world_size = 3;
  h.registering = registering;
  proofs.prove(h, registering, to, conn ? conn->handshake_transcript() : std::string(), HelloSide::dialer);
  return h;
}
Message frame(const Hello& h) { return hello_message(h); }

// The error text an Error frame carries.
std::string error_in(const OutFrame& f) {
  REQUIRE(f.head.kind == FrameKind::Error);
  Message m;
  m.head = f.head;
  m.body = f.body;
  try {
    std::rethrow_exception(decode_error(m, "worker0", "rendezvous"));
  } catch (const std::exception& e) {
    return e.what();
  }
  return {};
}
// What a refused connection was told, and that it was refused (nothing else sent).
std::string refusal(TableConnection& c) {
  REQUIRE(c.sent.size() == 1);
  CHECK(RpcSession::of(c).hello_refused);
  return error_in(c.sent[0]);
}

// A world table as rank 0 sends it, with every rank's key.
Message table_of(const std::vector<std::string>& keys) {
  Message m;
  m.head.kind = FrameKind::World;
  Writer w(m.body);
  std::vector<WorkerInfo> workers;
  std::vector<std::string> configs;
  std::vector<RankIdentity> identities;
  for (int r = 0; r < 3; ++r) {
    workers.push_back({name(r), r, "10.0.0.2", static_cast<std::uint16_t>(9000 + r)});
    configs.push_back(encode_device_config({}));
    identities.push_back({0, keys[r]});
  }
  w.put(workers);
  w.put(configs);
  w.put(std::vector<LocalAddress>(3));
  w.put(identities);
  w.put(std::string());
  return m;
}

}  // namespace

TEST_CASE("Rendezvous: a Hello is refused for each reason it can be, with the reason, and nothing else is sent") {
  Worker w(0);
  HelloProofs p1(1, 3, {});
  const auto refused_with = [&](Hello h, const std::string& why) {
    auto c = w.accepted();
    w.rendezvous.on_hello(c, frame(h));
    CAPTURE(why);
    CHECK(refusal(*c).find(why) != std::string::npos);
  };
  {
    auto c = w.accepted();
    Message garbage = frame(hello_of(1, p1, true));
    garbage.body.resize(3);
    w.rendezvous.on_hello(c, std::move(garbage));
    CHECK(refusal(*c).find("malformed hello") != std::string::npos);
  }
  Hello h = hello_of(1, p1, true);
  h.world_size = 4;
  refused_with(h, "world size 4 != 3");
  for (const int rank : {0, 3, -1}) {
    h = hello_of(1, p1, true);
    h.self.rank = rank;
    refused_with(h, "invalid rank " + std::to_string(rank));
  }
  // A registration anywhere but rank 0.
  Worker w1(1);
  auto c = w1.accepted();
  w1.rendezvous.on_hello(c, frame(hello_of(2, HelloProofs(2, 3, {}), true)));
  CHECK(refusal(*c).find("registration sent to rank 1") != std::string::npos);
  // Nothing of these reached the world: rank 0 still waits for ranks 1 and 2.
  CHECK(w.rendezvous.registrations().missing(3) == "1, 2");
  CHECK(w.host.tables.empty());
}

TEST_CASE("Rendezvous: a connection's second Hello, and an answer from another rank than the one dialled, close it") {
  Worker w(1);
  HelloProofs p2(2, 3, {});
  w.rendezvous.on_world(table_of({"k0", w.rendezvous.proofs().public_key(), p2.public_key()}));
  auto c = w.accepted();
  w.rendezvous.on_hello(c, frame(hello_of(2, p2, false, 1, c.get())));
  REQUIRE(c->sent.size() == 1);  // admitted, answered
  CHECK(c->sent[0].head.kind == FrameKind::Hello);
  CHECK(w.peers.speaker(2) == c);
  w.rendezvous.on_hello(c, frame(hello_of(2, p2, false, 1, c.get())));
  CHECK(c->closed_why == "protocol error: a second hello on one connection");
  CHECK(c->sent.size() == 1);

  auto ours = w.dialed(2);
  Hello answer = hello_of(0, HelloProofs(0, 3, {}), false);
  w.rendezvous.on_hello(ours, frame(answer));
  CHECK(ours->closed_why == "protocol error: hello from rank 0");
}

TEST_CASE("Rendezvous: a claim whose signature or name is not the table's is refused, and the rank keeps its speaker") {
  Worker w(1);
  HelloProofs p2(2, 3, {}), impostor(2, 3, {});
  w.rendezvous.on_world(table_of({"k0", w.rendezvous.proofs().public_key(), p2.public_key()}));
  {
    auto c = w.accepted();
    w.rendezvous.on_hello(c, frame(hello_of(2, impostor, false, 1, c.get())));  // another key
    CHECK(refusal(*c).find("its key is not the one rank 2 registered with") != std::string::npos);
  }
  {
    auto c = w.accepted();
    Hello h = hello_of(2, p2, false, 0, c.get());  // signed for rank 0, not us
    w.rendezvous.on_hello(c, frame(h));
    CHECK(refusal(*c).find("cannot prove it is rank 2") != std::string::npos);
  }
  {
    auto c = w.accepted();
    Hello h = hello_of(2, p2, false, 1, c.get());
    h.self.name = "someone";
    w.rendezvous.on_hello(c, frame(h));
    CHECK(refusal(*c).find("rank 2 is 'worker2', not 'someone'") != std::string::npos);
  }
  CHECK(w.peers.speaker(2) == nullptr);
  auto real = w.accepted();
  w.rendezvous.on_hello(real, frame(hello_of(2, p2, false, 1, real.get())));
  CHECK(w.peers.speaker(2) == real);
  auto second = w.accepted();  // the same process again, while its first connection speaks for it
  w.rendezvous.on_hello(second, frame(hello_of(2, p2, false, 1, second.get())));
  CHECK(refusal(*second).find("rank 2") != std::string::npos);
  CHECK(w.peers.speaker(2) == real);
}

TEST_CASE("Rendezvous: rank 0 answers each registration, then sends everyone the table once all are in") {
  Worker w(0);
  HelloProofs p1(1, 3, {}), p2(2, 3, {});
  auto a = w.accepted(), b = w.accepted();
  w.rendezvous.on_hello(a, frame(hello_of(1, p1, true)));
  REQUIRE(a->sent.size() == 1);
  CHECK(a->sent[0].head.kind == FrameKind::Hello);
  CHECK(!w.rendezvous.world().known());
  CHECK(!w.rendezvous.world_ready().get_future().done());
  CHECK(w.rendezvous.registrations().missing(3) == "2");

  w.rendezvous.on_hello(b, frame(hello_of(2, p2, true)));
  for (const auto& c : {a, b}) {
    REQUIRE(c->sent.size() == 2);
    CHECK(c->sent[0].head.kind == FrameKind::Hello);
    CHECK(c->sent[1].head.kind == FrameKind::World);
  }
  REQUIRE(w.host.tables.size() == 1);
  REQUIRE(w.host.tables[0].size() == 3);
  for (int r = 0; r < 3; ++r) CHECK(w.host.tables[0][r].name == name(r));
  CHECK(w.rendezvous.world().known());
  CHECK_NOTHROW(w.rendezvous.world_ready().get_future().wait());
  CHECK(w.peers.speaker(1) == a);
  CHECK(w.peers.speaker(2) == b);

  // Complete now: a late registration is turned away, as is a replacement without the launcher's credential.
  auto late = w.accepted();
  w.rendezvous.on_hello(late, frame(hello_of(1, HelloProofs(1, 3, {}), true)));
  CHECK(refusal(*late).find("the world is already complete") != std::string::npos);
  auto replacement = w.accepted();
  Hello h = hello_of(1, HelloProofs(1, 3, {}), true);
  h.rejoining = true;
  w.rendezvous.on_hello(replacement, frame(h));
  CHECK(refusal(*replacement).find("a replacement must prove it is rank 1") != std::string::npos);
  CHECK(w.host.tables.size() == 1);
}

TEST_CASE("Rendezvous: two ranks that register one name fail the job at once; a rank registered twice is refused") {
  Worker w(0);
  auto a = w.accepted(), b = w.accepted(), c = w.accepted();
  w.rendezvous.on_hello(a, frame(hello_of(1, HelloProofs(1, 3, {}), true)));
  w.rendezvous.on_hello(b, frame(hello_of(1, HelloProofs(1, 3, {}), true)));
  CHECK(refusal(*b).find("rank 1 already registered by 'worker1'") != std::string::npos);
  Hello h = hello_of(2, HelloProofs(2, 3, {}), true);
  h.self.name = name(1);
  w.rendezvous.on_hello(c, frame(h));
  CHECK(refusal(*c).find("worker name 'worker1' is already taken by rank 1") != std::string::npos);
  REQUIRE(a->sent.size() == 2);  // its answer, then the same refusal
  CHECK(error_in(a->sent[1]).find("worker name 'worker1' is already taken") != std::string::npos);
  CHECK_THROWS_AS(w.rendezvous.world_ready().get_future().wait(), UsageError);
  CHECK(w.host.tables.empty());
}

TEST_CASE(
    "Rendezvous: a claim that comes before the table waits with what follows it, and goes back on its own "
    "connection's thread, in order") {
  Worker w(1);
  HelloProofs p2(2, 3, {});
  asio::io_context conn_io;  // the connection's I/O thread, run below
  auto c = w.accepted(&conn_io);
  w.rendezvous.on_hello(c, frame(hello_of(2, p2, false, 1, c.get())));
  Message request;
  request.head.kind = FrameKind::Request;
  CHECK(w.rendezvous.world().park_if_unknown(c, request));  // what the request side does with what follows
  CHECK(c->sent.empty());
  CHECK(w.host.dispatched.empty());
  // The frames handed back go where the runtime's dispatcher would send them: the Hello to the rendezvous again.
  w.host.on_dispatch = [&](const std::shared_ptr<Connection>& conn, Message&& msg) {
    if (msg.head.kind == FrameKind::Hello) w.rendezvous.on_hello(conn, std::move(msg));
  };
  w.rendezvous.on_world(table_of({"k0", w.rendezvous.proofs().public_key(), p2.public_key()}));
  CHECK(w.rendezvous.world_ready().get_future().done());
  CHECK(w.host.dispatched.empty());  // not on this thread
  std::thread::id io_thread;
  std::thread runner([&] {
    io_thread = std::this_thread::get_id();
    conn_io.run();
  });
  runner.join();
  REQUIRE(w.host.dispatched.size() == 2);
  CHECK(w.host.dispatched[0].kind == FrameKind::Hello);
  CHECK(w.host.dispatched[1].kind == FrameKind::Request);
  for (const auto& d : w.host.dispatched) CHECK(d.thread == io_thread);
  REQUIRE(c->sent.size() == 1);  // the claim, judged against the table: admitted and answered
  CHECK(c->sent[0].head.kind == FrameKind::Hello);
  CHECK(w.peers.speaker(2) == c);
  Message after;
  CHECK(!w.rendezvous.world().park_if_unknown(c, after));  // nothing waits any more
}

TEST_CASE(
    "Rendezvous: a rank that rejoins with the launcher's credential replaces its predecessor once that one is "
    "gone; every other rank is told") {
  const std::string key = random_secret();
  const auto dealt = [&](int rank, std::uint32_t incarnation) {
    return RankProofs{rank == 0 ? key : std::string(), rank_credential(key, rank, incarnation), incarnation};
  };
  Worker w(0, dealt(0, 0));
  HelloProofs p1(1, 3, dealt(1, 0)), p2(2, 3, dealt(2, 0));
  auto a = w.accepted(), b = w.accepted();
  w.rendezvous.on_hello(a, frame(hello_of(1, p1, true)));
  w.rendezvous.on_hello(b, frame(hello_of(2, p2, true)));
  REQUIRE(w.rendezvous.world().known());

  HelloProofs next(1, 3, dealt(1, 1));
  const auto rejoin = [&](const HelloProofs& proofs) {
    auto c = w.accepted();
    Hello h = hello_of(1, proofs, true);
    h.rejoining = true;
    w.rendezvous.on_hello(c, frame(h));
    return c;
  };
  // While the predecessor's connection still speaks for rank 1 (no wait: the handshake timeout is 0).
  auto early = rejoin(next);
  CHECK(refusal(*early).find("rank 1 is still connected here") != std::string::npos);
  // Without the credential for its incarnation.
  w.peers.remove(a);
  auto forged = rejoin(HelloProofs(1, 3, {std::string(), rank_credential("another key", 1, 1), 1}));
  CHECK(refusal(*forged).find("does not hold the launcher's credential for rank 1, incarnation 1") !=
        std::string::npos);
  CHECK(w.host.restarted.empty());

  const std::size_t b_before = b->sent.size();
  auto admitted = rejoin(next);
  REQUIRE(admitted->sent.size() == 2);  // its answer, then the current table with rank 0's certificate
  CHECK(admitted->sent[0].head.kind == FrameKind::Hello);
  CHECK(admitted->sent[1].head.kind == FrameKind::World);
  CHECK(w.peers.speaker(1) == admitted);
  CHECK(w.host.forgotten == std::vector<int>{1});
  CHECK(w.host.restarted == std::vector<int>{1});
  REQUIRE(b->sent.size() == b_before + 1);  // rank 2 takes the new incarnation from an update of the table
  CHECK(b->sent.back().head.kind == FrameKind::World);
  CHECK(w.rendezvous.proofs().identities().get(1).incarnation == 1);
  // The same incarnation again is no newer than the one that registered.
  w.peers.remove(admitted);
  auto again = rejoin(next);
  CHECK(refusal(*again).find("incarnation 1 of rank 1 is not newer") != std::string::npos);
}

}  // namespace test_rendezvous
