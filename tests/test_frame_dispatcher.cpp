// The frame dispatcher (src/rpc/frame_dispatcher.hpp) on its own: which owner each frame kind reaches, and what is
// never routed. Owners here record what they were given; the connection is a fake that sends nothing.
#include <doctest/doctest.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../src/rpc/frame_dispatcher.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_frame_dispatcher {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

namespace {

constexpr Route kAll[] = {Route::hello,     Route::world, Route::refusal,  Route::request, Route::cancel,
                          Route::oversized, Route::reply, Route::ipc_done, Route::goodbye, Route::on_devices};

// A dispatcher whose every route records (route, frame id) in `seen`.
struct Recorder {
  FrameDispatcher frames;
  std::vector<std::pair<Route, std::uint64_t>> seen;
  Recorder() {
    for (Route r : kAll)
      frames.on(r, [this, r](const std::shared_ptr<Connection>&, Message&& m) { seen.emplace_back(r, m.head.id); });
  }
};

// A connection we dialed, with the session the runtime's connections carry (only its RPC state: no calls here).
std::shared_ptr<Connection> dialed_connection(asio::io_context& io) {
  return corpc::test::table_connection(io, "10.0.0.1:1", [](asio::io_context&) -> std::unique_ptr<ConnectionSession> {
    return std::make_unique<RpcSession>(/*dialed=*/true);
  });
}

Message frame(FrameKind kind, std::uint64_t id, std::uint16_t flags = 0) {
  Message m;
  m.head.kind = kind;
  m.head.id = id;
  m.head.flags = flags;
  return m;
}

}  // namespace

TEST_CASE("FrameDispatcher: each kind goes to its owner; an error for id 0 is a refusal, a cancel flag a cancel") {
  CHECK((route_of(frame(FrameKind::Hello, 0).head) == Route::hello));
  CHECK((route_of(frame(FrameKind::World, 0).head) == Route::world));
  CHECK((route_of(frame(FrameKind::Request, 5).head) == Route::request));
  CHECK((route_of(frame(FrameKind::Request, 5, kFlagControl).head) == Route::request));
  CHECK((route_of(frame(FrameKind::Request, 5, kFlagControl | kFlagCancel).head) == Route::cancel));
  CHECK((route_of(frame(FrameKind::Response, 5).head) == Route::reply));
  CHECK((route_of(frame(FrameKind::Error, 5).head) == Route::reply));
  CHECK((route_of(frame(FrameKind::Error, 0).head) == Route::refusal));
  CHECK((route_of(frame(FrameKind::IpcDone, 0).head) == Route::ipc_done));
  CHECK((route_of(frame(FrameKind::Goodbye, 0).head) == Route::goodbye));
  CHECK_FALSE(route_of(frame(FrameKind::Ping, 0).head).has_value());  // the transport answers these
  CHECK_FALSE(route_of(frame(FrameKind::Pong, 0).head).has_value());
  FrameHeader unknown;
  unknown.kind = static_cast<FrameKind>(200);
  CHECK_FALSE(route_of(unknown).has_value());
}

TEST_CASE("FrameDispatcher: dispatch hands the frame to the registered owner, once, in order") {
  asio::io_context io;
  auto conn = dialed_connection(io);
  Recorder r;
  r.frames.dispatch(conn, frame(FrameKind::Request, 7));
  r.frames.dispatch(conn, frame(FrameKind::Response, 8));
  r.frames.dispatch(conn, frame(FrameKind::Ping, 9));  // nowhere
  r.frames.dispatch(conn, frame(FrameKind::Error, 0));
  REQUIRE(r.seen.size() == 3);
  CHECK((r.seen[0].first == Route::request && r.seen[0].second == 7));
  CHECK((r.seen[1].first == Route::reply && r.seen[1].second == 8));
  CHECK((r.seen[2].first == Route::refusal && r.seen[2].second == 0));
}

TEST_CASE("FrameDispatcher: tensors bound for devices go to device delivery first, whatever their kind") {
  asio::io_context io;
  auto conn = dialed_connection(io);
  Recorder r;
  Message m = frame(FrameKind::Response, 3);
  m.devices = {0};
  r.frames.dispatch(conn, std::move(m));
  REQUIRE(r.seen.size() == 1);
  CHECK((r.seen[0].first == Route::on_devices));
}

TEST_CASE("FrameDispatcher: nothing a connection whose Hello was refused says is routed; an unowned route drops") {
  asio::io_context io;
  auto conn = dialed_connection(io);
  Recorder r;
  RpcSession& session = RpcSession::of(*conn);
  session.hello_refused = true;
  for (auto kind : {FrameKind::Hello, FrameKind::Request, FrameKind::Response, FrameKind::Goodbye})
    r.frames.dispatch(conn, frame(kind, 1));
  CHECK(r.seen.empty());
  CHECK(session.said_goodbye);  // recorded all the same: the refused peer's close is an orderly one
  session.hello_refused = false;
  FrameDispatcher empty;
  empty.dispatch(conn, frame(FrameKind::Request, 1));  // no owner: dropped, nothing else happens
  r.frames.on(Route::goodbye, nullptr);
  r.frames.dispatch(conn, frame(FrameKind::Goodbye, 2));
  CHECK(r.seen.empty());
}

}  // namespace test_frame_dispatcher
