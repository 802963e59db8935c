// The same-host part (src/rpc/same_host.hpp) on its own, without peers: what it announces and offers, and what a
// dialer sets up, from the Hellos alone. A connection that records the set-up it is handed plays the wire; the
// channel itself (its segment and its Unix socket) is tested in test_shm_channel.cpp.
#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <string>

#include "../src/rpc/same_host.hpp"
#include "../src/transport/shm_channel.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_same_host {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

namespace {

// A connection that keeps the channel set-up it is handed for later (the first large message), and sends nothing.
class SetUpRecorder final : public Connection {
 public:
  explicit SetUpRecorder(asio::io_context& io) : Connection(io, {}) { peer_rank = 1; }
  void send(OutFrame&&) override {}
  void close(std::string) override {}
  void close_when_flushed() override {}
  std::string handshake_transcript() const override { return "transcript"; }
  void set_up_shm_when_needed(std::function<void()> set_up) override { later = std::move(set_up); }
  std::function<void()> later;
};

SameHost::Settings on() {
  return {.channel = true,
          .cuda_ipc = false,
          .ring_bytes = 1 << 20,
          .handshake_timeout = std::chrono::seconds(1),
          .secret = "secret",
          .worker = "worker0"};
}

// A peer's Hello (or answer) from host `host`, offering a channel with `cookie` when it is not empty.
Hello from(const std::string& host, const std::string& cookie = {}) {
  Hello h;
  h.host = host;
  h.shm_socket = cookie.empty() ? "" : "corpc-shm-test";
  h.shm_cookie = cookie;
  return h;
}

}  // namespace

TEST_CASE("SameHost: switched off, it announces no host, offers no channel and sets none up") {
  asio::io_context io;
  SameHost same;
  auto settings = on();
  settings.channel = false;
  same.start(io, settings);
  CHECK(same.host_id().empty());
  CHECK_FALSE(same.cuda_ipc_offered());
  auto conn = std::make_shared<SetUpRecorder>(io);
  Hello answer;
  same.offer(conn, from(same_host_identity()), answer);
  CHECK(answer.shm_socket.empty());
  CHECK(answer.shm_cookie.empty());
  same.dial(conn, from(same_host_identity(), "cookie"));
  CHECK_FALSE(conn->later);
}

TEST_CASE("SameHost: it offers a channel to a peer on this host only, each connection its own cookie") {
  asio::io_context io;
  SameHost same;
  same.start(io, on());
  if (same.host_id().empty()) return;  // no boot id to read here: nobody could tell who is on this host
  CHECK(same.host_id() == same_host_identity());
  CHECK_FALSE(same.cuda_ipc_offered());  // RpcOptions::cuda_ipc off
  auto conn = std::make_shared<SetUpRecorder>(io);
  Hello elsewhere;
  same.offer(conn, from("another host"), elsewhere);
  CHECK(elsewhere.shm_cookie.empty());
  Hello here, again;
  same.offer(conn, from(same.host_id()), here);
  same.offer(conn, from(same.host_id()), again);
  CHECK_FALSE(here.shm_socket.empty());
  CHECK_FALSE(here.shm_cookie.empty());
  CHECK(here.shm_cookie != again.shm_cookie);
  same.close();
}

TEST_CASE("SameHost: a dialer sets up a channel offered from this host, when the first large message crosses") {
  asio::io_context io;
  SameHost same;
  same.start(io, on());
  if (same.host_id().empty()) return;
  auto conn = std::make_shared<SetUpRecorder>(io);
  same.dial(conn, from("another host", "cookie"));  // not our host: TCP only
  CHECK_FALSE(conn->later);
  same.dial(conn, from(same.host_id()));  // on our host, but nothing offered
  CHECK_FALSE(conn->later);
  same.dial(conn, from(same.host_id(), "cookie"));
  CHECK(conn->later);  // left for later, not started: no CUDA IPC agreed
  same.close();
}

}  // namespace test_same_host
