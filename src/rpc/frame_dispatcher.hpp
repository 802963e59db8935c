// Routes each frame a connection delivers to the part of the runtime that owns it. The owners register their routes
// when the runtime is made (Runtime::Impl::route_frames), before any connection exists; dispatch() then reads the
// table without a lock, on the connection's I/O thread.
//
//   route       frames                                   owner
//   hello       Hello                                    rendezvous (rendezvous.cpp)
//   world       World                                    rendezvous
//   refusal     Error with id 0: our Hello was refused   rendezvous
//   request     Request                                  the request side (request_server.hpp)
//   cancel      Request with kFlagCancel                 the request side
//   oversized   a request whose bytes the transport      the request side
//               dropped (over the receive budget)
//   reply       Response, Error for a request of ours    the connection's call engine (call_engine.hpp)
//   ipc_done    IpcDone                                  the same-host channel (same_host.cpp)
//   goodbye     Goodbye                                  peers (peers.cpp)
//   on_devices  any frame with tensors bound for CUDA    device delivery (device_delivery.cpp), which dispatches
//               devices                                  it again once they are there
// Ping and Pong are answered by the transport and go nowhere. A connection whose Hello was refused is closing once
// the refusal is out: nothing more it says is routed. The owners register their routes with one function each, of
// one form: route_<owner>(FrameDispatcher&, what it needs), called by route_frames.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>

#include "corpc/wire/detail/message.hpp"

#include "rpc/rpc_session.hpp"
#include "transport/connection.hpp"

namespace corpc::detail {

enum class Route : std::uint8_t {
  hello,
  world,
  refusal,
  request,
  cancel,
  oversized,
  reply,
  ipc_done,
  goodbye,
  on_devices
};
inline constexpr std::size_t kRoutes = static_cast<std::size_t>(Route::on_devices) + 1;

// Where a frame with header `h` goes once its tensors are where they belong; nullopt: nowhere.
inline std::optional<Route> route_of(const FrameHeader& h) noexcept {
  switch (h.kind) {
    case FrameKind::Hello: return Route::hello;
    case FrameKind::World: return Route::world;
    case FrameKind::Request: return (h.flags & kFlagCancel) ? Route::cancel : Route::request;
    case FrameKind::Response: return Route::reply;
    case FrameKind::Error: return h.id == 0 ? Route::refusal : Route::reply;
    case FrameKind::IpcDone: return Route::ipc_done;
    case FrameKind::Goodbye: return Route::goodbye;
    case FrameKind::Ping:
    case FrameKind::Pong: return std::nullopt;
  }
  return std::nullopt;
}

class FrameDispatcher {
 public:
  using Handler = std::function<void(const std::shared_ptr<Connection>&, Message&&)>;

  // Makes `handler` the owner of `route` (replacing any before it). Before the first dispatch only.
  void on(Route route, Handler handler) { routes_[static_cast<std::size_t>(route)] = std::move(handler); }

  void dispatch(const std::shared_ptr<Connection>& conn, Message&& msg) const {
    RpcSession& session = RpcSession::of(*conn);
    // Recorded before anything is routed, a refused peer's too: its close is then an orderly one (peers.cpp).
    if (msg.head.kind == FrameKind::Goodbye) [[unlikely]]
      session.said_goodbye = true;
    if (session.hello_refused) return;
    if (conn->delivering_refused()) return to(Route::oversized, conn, std::move(msg));
    if (!msg.devices.empty()) [[unlikely]]
      return to(Route::on_devices, conn, std::move(msg));
    if (const auto route = route_of(msg.head)) to(*route, conn, std::move(msg));
  }

 private:
  void to(Route route, const std::shared_ptr<Connection>& conn, Message&& msg) const {
    const auto& handler = routes_[static_cast<std::size_t>(route)];
    if (handler) handler(conn, std::move(msg));
  }

  std::array<Handler, kRoutes> routes_;
};

}  // namespace corpc::detail
