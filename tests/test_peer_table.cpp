// Who speaks for each rank (PeerTable), in process, on the real table over fake connections that hold only what it
// reads (tests/fake_connection.hpp; no workers, no sockets): the connection that speaks for a rank and the claimants
// it refuses, our dialed connection, dead ranks and why, new incarnations and their moved addresses, the close.
#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <vector>

#include "../src/rpc/peer_table.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_peer_table {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

using corpc::test::table_connection;

TEST_CASE("PeerTable: one connection speaks for a rank; a claimant is refused while it lives, admitted after it goes") {
  asio::io_context io;
  PeerTable table(3);
  auto first = table_connection(io, "10.0.0.1");
  auto second = table_connection(io, "10.0.0.2");
  int admitted = 0;
  CHECK_FALSE(table.claim(1, first, [&] { ++admitted; }).has_value());
  CHECK(admitted == 1);
  CHECK(first->peer_rank == 1);
  auto refusal = table.claim(1, second, [&] { ++admitted; });
  REQUIRE(refusal.has_value());
  CHECK(refusal->find("rank 1 is already connected here (from 10.0.0.1)") != std::string::npos);
  CHECK(admitted == 1);  // nothing recorded for the refused one
  CHECK(second->peer_rank == -1);
  CHECK_FALSE(table.claim(2, second).has_value());  // another rank is free
  // The loss of a connection that does not speak for the rank is its own: the holder stays.
  auto stranger = table_connection(io, "10.0.0.3");
  stranger->peer_rank = 1;
  CHECK_FALSE(table.remove(stranger).speaks_for_rank);
  CHECK(table.claim(1, table_connection(io, "10.0.0.4")).has_value());
  // The holder's loss is the rank's, and frees it.
  auto loss = table.remove(first);
  CHECK(loss.speaks_for_rank);
  CHECK_FALSE(loss.while_closing);
  CHECK_FALSE(table.claim(1, table_connection(io, "10.0.0.5")).has_value());
}

TEST_CASE("PeerTable: our connection is dialed once; a dead rank refuses calls with why; closing refuses everything") {
  asio::io_context io;
  PeerTable table(2);
  int dials = 0;
  auto dial = [&](const PeerTable::Address* moved) {
    CHECK(moved == nullptr);  // nobody rejoined
    ++dials;
    auto c = table_connection(io, "10.0.0.1");
    c->peer_rank = 1;
    return c;
  };
  auto ours = table.outgoing_to(1, "w1", dial);
  CHECK(table.outgoing_to(1, "w1", dial) == ours);
  CHECK(dials == 1);
  CHECK(table.outgoing_if(1, ours.get()) == ours);
  CHECK(table.outgoing_if(1, nullptr) == nullptr);
  CHECK(table.outgoing_if(7, ours.get()) == nullptr);
  CHECK(table.outgoing_connections().size() == 1);
  CHECK(table.is_alive(1));
  CHECK_FALSE(table.is_alive(2));
  CHECK_FALSE(table.is_alive(-1));

  auto news = table.mark_dead(1, "it went silent");
  REQUIRE(news.has_value());
  CHECK(*news == ours);                                  // to be closed by the caller
  CHECK_FALSE(table.mark_dead(1, "again").has_value());  // not news
  CHECK_FALSE(table.is_alive(1));
  CHECK(table.deaths() == std::vector<std::string>{"", "it went silent"});
  try {
    table.outgoing_to(1, "w1", dial);
    FAIL("a dead rank was dialed");
  } catch (const ConnectionError& e) {
    CHECK(std::string(e.what()).find("worker 'w1' (rank 1) is gone: it went silent") != std::string::npos);
  }
  CHECK(dials == 1);
  // Our connection's loss is always the rank's; it is forgotten.
  CHECK(table.remove(ours).speaks_for_rank);
  CHECK(table.outgoing_connections().empty());

  table.set_farewell(0, "out of memory");
  table.set_farewell(5, "ignored: no such rank");
  CHECK(table.farewell(0) == "out of memory");
  CHECK(table.farewell(5).empty());

  auto accepted = table_connection(io, "10.0.0.9");
  CHECK(table.add_incoming(accepted));
  CHECK(table.any_open(0));
  auto all = table.close();
  CHECK(all == std::vector<std::shared_ptr<Connection>>{accepted});
  CHECK_FALSE(table.add_incoming(table_connection(io, "10.0.0.10")));
  CHECK_THROWS_AS(table.outgoing_to(0, "w0", dial), ShutdownError);
  CHECK(table.remove(accepted).while_closing);
  CHECK_FALSE(table.any_open(0));
}

TEST_CASE("PeerTable: a new incarnation revives a dead rank once its predecessor's connection is gone, and moves it") {
  asio::io_context io;
  PeerTable table(2);
  auto dial_at = [&](std::string* where) {
    return [&, where](const PeerTable::Address* moved) {
      *where = moved ? moved->host + ":" + std::to_string(moved->port) : "table";
      auto c = table_connection(io, "10.0.0.1");
      c->peer_rank = 1;
      return c;
    };
  };
  std::string where;
  auto old_ours = table.outgoing_to(1, "w1", dial_at(&where));
  CHECK(where == "table");
  auto old_theirs = table_connection(io, "10.0.0.1");
  table.add_incoming(old_theirs);
  REQUIRE_FALSE(table.claim(1, old_theirs).has_value());

  auto newcomer = table_connection(io, "10.0.0.2");
  table.add_incoming(newcomer);
  bool admitted = false;
  auto [refusal, old] = table.revive(1, newcomer, {"10.0.0.2", 4242, {}}, [&] { admitted = true; });
  REQUIRE(refusal.has_value());  // the predecessor still speaks for the rank here
  CHECK(refusal->find("still connected") != std::string::npos);
  CHECK_FALSE(admitted);
  CHECK(old == nullptr);

  table.mark_dead(1, "killed");
  CHECK(table.remove(old_theirs).speaks_for_rank);
  auto [refusal2, old2] =
      table.revive(1, newcomer, {"10.0.0.2", 4242, {"host-a", "new-socket"}}, [&] { admitted = true; });
  CHECK_FALSE(refusal2.has_value());
  CHECK(admitted);
  CHECK(old2 == old_ours);  // our connection to the predecessor, for the caller to close
  CHECK(table.is_alive(1));
  CHECK(newcomer->peer_rank == 1);
  auto ours = table.outgoing_to(1, "w1", dial_at(&where));
  CHECK(where == "10.0.0.2:4242");
  CHECK(ours != old_ours);
  std::vector<WorkerInfo> workers(2);
  workers[1].host = "10.0.0.1";
  workers[1].port = 1;
  auto now = table.current_addresses(workers);
  CHECK(now[1].host == "10.0.0.2");
  CHECK(now[1].port == 4242);
  const auto local_now = table.current_local_addresses({{"host-a", "socket0"}, {"host-a", "old-socket"}});
  CHECK((local_now == std::vector<LocalAddress>{{"host-a", "socket0"}, {"host-a", "new-socket"}}));
  table.close();
}

TEST_CASE("PeerTable: a loopback to ourselves does not keep the table open; a connection to a peer does") {
  asio::io_context io;
  PeerTable table(2);
  table.outgoing_to(0, "w0", [&](const PeerTable::Address*) {
    auto c = table_connection(io, "");
    c->peer_rank = 0;
    return c;
  });
  CHECK_FALSE(table.any_open(0));
  table.outgoing_to(1, "w1", [&](const PeerTable::Address*) {
    auto c = table_connection(io, "10.0.0.1");
    c->peer_rank = 1;
    return c;
  });
  CHECK(table.any_open(0));
}

}  // namespace test_peer_table
