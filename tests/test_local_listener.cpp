// The same-host listener (src/rpc/local_listener.hpp) on its own, with a host of the test's in place of the runtime:
// a peer on this host that connects to the address it announces is handed over as an adopted socket, on the I/O
// thread the host picks. Nothing is authenticated here: that is the runtime's, after the hand-over.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include "../src/rpc/local_listener.hpp"
#include "../src/transport/shm_channel.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_local_listener {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {

class TestHost final : public LocalListener::Host {
 public:
  asio::io_context& pick_io() override { return io; }
  void serve_local(asio::ip::tcp::socket socket) override { served.push_back(std::move(socket)); }
  void local_accept_failed() override { ++failures; }

  asio::io_context io;
  std::vector<asio::ip::tcp::socket> served;
  int failures = 0;
};

}  // namespace

TEST_CASE("LocalListener: a peer on this host that dials the announced address is handed over, one socket each") {
  TestHost host;
  LocalListener listener;
  listener.start(host, host.io, "worker0");
  if (same_host_identity().empty()) {  // no boot id to read here: nobody could tell who is on this host
    CHECK(listener.address().socket.empty());
    return;
  }
  REQUIRE_FALSE(listener.address().socket.empty());
  CHECK(listener.address().host == same_host_identity());
  listener.accept();
  const asio::local::stream_protocol::endpoint at(std::string(1, '\0') + listener.address().socket);
  asio::local::stream_protocol::socket first(host.io), second(host.io);
  first.connect(at);
  second.connect(at);
  for (int i = 0; i < 500 && host.served.size() < 2; ++i) {
    host.io.restart();
    host.io.run_for(10ms);
  }
  CHECK(host.served.size() == 2);
  CHECK(host.failures == 0);
  listener.close();
}

TEST_CASE("LocalListener: never started, it announces no address and accepts nothing") {
  LocalListener listener;
  CHECK(listener.address().socket.empty());
  CHECK(listener.address().host.empty());
  listener.accept();  // nothing to accept on
  listener.close();
}

}  // namespace test_local_listener
