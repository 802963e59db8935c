// Rank 0's rendezvous state, in process, on the real objects over fake connections that hold only what they read
// (tests/fake_connection.hpp; no workers, no sockets): the registrations that make the worker table (Registrations:
// duplicates refused, the table published once, complete and in rank order) and the gate that parks requests until
// the table is known (WorldGate: parked in order, none lost in a race, none overtaking what its connection parked).
#include <doctest/doctest.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../src/rpc/rendezvous_state.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_rendezvous_state {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

using corpc::test::table_connection;

namespace {

WorkerInfo worker(std::string name, int rank) {
  WorkerInfo w;
  w.name = std::move(name);
  w.rank = rank;
  return w;
}

}  // namespace

TEST_CASE("Registrations: a rank or a name registered twice is refused; an admit() refusal records nothing") {
  asio::io_context io;
  Registrations regs;
  regs.add_own(worker("master", 0), "config0", {});
  CHECK(regs.missing(3) == "1, 2");
  auto a = table_connection(io, "10.0.0.1");
  auto b = table_connection(io, "10.0.0.2");
  int admits = 0;
  auto admit = [&] { return ++admits, std::optional<std::string>{}; };
  auto ok = regs.add(worker("w1", 1), a, "config1", {}, admit);
  CHECK_FALSE(ok.rank_taken);
  CHECK_FALSE(ok.not_admitted);
  CHECK_FALSE(ok.duplicate_name);
  CHECK(admits == 1);

  auto same_rank = regs.add(worker("other", 1), b, "", {}, admit);
  REQUIRE(same_rank.rank_taken);
  CHECK(*same_rank.rank_taken == "rank 1 already registered by 'w1'");
  CHECK(admits == 1);

  auto same_name = regs.add(worker("w1", 2), b, "", {}, admit);
  REQUIRE(same_name.duplicate_name);
  CHECK(same_name.duplicate_name->find("worker name 'w1' is already taken by rank 1 (rank 2 claims it too)") !=
        std::string::npos);
  CHECK(same_name.others == std::vector<std::shared_ptr<Connection>>{a});  // rank 0 itself has no connection
  CHECK(admits == 1);

  auto not_admitted = regs.add(worker("w2", 2), b, "", {}, [] { return std::optional<std::string>("spoken for"); });
  REQUIRE(not_admitted.not_admitted);
  CHECK(*not_admitted.not_admitted == "spoken for");
  CHECK(regs.missing(3) == "2");
  CHECK_FALSE(regs.take_if_complete(3).has_value());
}

TEST_CASE("Registrations: the table goes out once, complete and in rank order; a registrant that left is forgotten") {
  asio::io_context io;
  Registrations regs;
  regs.add_own(worker("master", 0), "config0", {"host-a", "socket0"});
  auto c2 = table_connection(io, "10.0.0.2");
  auto c1 = table_connection(io, "10.0.0.1");
  auto none = [] { return std::optional<std::string>{}; };
  regs.add(worker("w2", 2), c2, "config2", {"host-b", "stale"}, none);
  regs.forget(c2);
  CHECK(regs.missing(3) == "1, 2");
  regs.add(worker("w2", 2), c2, "config2", {"host-b", "socket2"}, none);
  regs.add(worker("w1", 1), c1, "config1", {}, none);
  auto world = regs.take_if_complete(3);
  REQUIRE(world.has_value());
  REQUIRE(world->workers.size() == 3);
  for (int r = 0; r < 3; ++r) CHECK(world->workers[r].rank == r);
  CHECK(world->device_configs == std::vector<std::string>{"config0", "config1", "config2"});
  CHECK((world->local == std::vector<LocalAddress>{{"host-a", "socket0"}, {}, {"host-b", "socket2"}}));
  CHECK(world->registrants == std::vector<std::shared_ptr<Connection>>{c1, c2});
  CHECK_FALSE(regs.take_if_complete(3).has_value());  // once
}

TEST_CASE("Registrations: two registrations completing at once publish the table once") {
  for (int round = 0; round < 50; ++round) {
    asio::io_context io;
    Registrations regs;
    regs.add_own(worker("master", 0), "", {});
    auto none = [] { return std::optional<std::string>{}; };
    std::atomic<int> published{0};
    auto registrant = [&](int rank) {
      regs.add(worker("w" + std::to_string(rank), rank), table_connection(io, "10.0.0.1"), "", {}, none);
      if (regs.take_if_complete(3)) published++;
    };
    std::thread t1(registrant, 1), t2(registrant, 2);
    t1.join();
    t2.join();
    CHECK(published.load() == 1);
  }
}

TEST_CASE("WorldGate: requests before the table are parked and handed back in order; after it none is parked") {
  asio::io_context io;
  WorldGate gate;
  auto conn = table_connection(io, "10.0.0.1");
  CHECK(gate.first_table());
  CHECK_FALSE(gate.first_table());
  CHECK_FALSE(gate.known());
  for (int i = 0; i < 3; ++i) {
    Message m;
    m.body = "request " + std::to_string(i);
    CHECK(gate.park_if_unknown(conn, m));
  }
  auto held = gate.open();
  CHECK(gate.known());
  REQUIRE(held.size() == 1);
  CHECK(held[0] == conn);
  auto parked = gate.take(*conn);
  REQUIRE(parked.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(parked[i].body == "request " + std::to_string(i));
  Message late;
  late.body = "late";
  CHECK_FALSE(gate.park_if_unknown(conn, late));
  CHECK(late.body == "late");  // untouched: the caller delivers it
  CHECK(gate.take(*conn).empty());
  CHECK(gate.open().empty());
}

TEST_CASE("WorldGate: a connection's frames read after the table wait behind those it parked before, until taken") {
  // A peer's Hello and first request arrive before our table; the table completes on another I/O thread, and the
  // connection's own thread reads a second request before it takes back what was parked. Delivered at once, that
  // request would overtake the parked Hello: its sender would be refused as having sent no Hello, and lose us.
  asio::io_context io;
  WorldGate gate;
  auto early = table_connection(io, "10.0.0.1");
  auto other = table_connection(io, "10.0.0.2");
  for (const char* body : {"hello", "request 1"}) {
    Message m;
    m.body = body;
    CHECK(gate.park_if_unknown(early, m));
  }
  const auto held = gate.open();
  REQUIRE(held.size() == 1);
  Message second;
  second.body = "request 2";
  CHECK(gate.park_if_unknown(early, second));  // behind the parked ones
  Message elsewhere;
  elsewhere.body = "unrelated";
  CHECK_FALSE(gate.park_if_unknown(other, elsewhere));  // a connection that parked nothing is not held up
  const auto parked = gate.take(*early);
  REQUIRE(parked.size() == 3);
  CHECK(parked[0].body == "hello");
  CHECK(parked[1].body == "request 1");
  CHECK(parked[2].body == "request 2");
  Message third;
  third.body = "request 3";
  CHECK_FALSE(gate.park_if_unknown(early, third));  // taken back: from here on in order by itself
}

TEST_CASE("WorldGate: a request racing the table is either parked and handed back, or delivered, never lost") {
  for (int round = 0; round < 20; ++round) {
    asio::io_context io;
    WorldGate gate;
    auto conn = table_connection(io, "10.0.0.1");
    constexpr int kRequests = 2000;
    std::atomic<int> delivered_directly{0};
    std::atomic<bool> taken{false};
    std::vector<std::string> order;  // what the connection's thread acts on, in order
    std::vector<Message> parked;
    std::thread reader([&] {  // the connection's I/O thread: reads, and takes back what it parked once the table is in
      bool took = false;
      for (int i = 0; i < kRequests; ++i) {
        if (!took && taken.load()) {
          for (auto& m : gate.take(*conn)) order.push_back(m.body);
          took = true;
        }
        Message m;
        m.body = std::to_string(i);
        if (!gate.park_if_unknown(conn, m)) {
          delivered_directly++;
          order.push_back(m.body);
        }
      }
      if (!took)
        for (auto& m : gate.take(*conn)) order.push_back(m.body);
    });
    std::this_thread::yield();
    gate.open();
    taken.store(true);
    reader.join();
    REQUIRE(static_cast<int>(order.size()) == kRequests);
    for (int i = 0; i < kRequests; ++i) CHECK(order[i] == std::to_string(i));
  }
}

}  // namespace test_rendezvous_state
