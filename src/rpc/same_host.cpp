// The same-host channel's set-up between two workers (src/transport/shm_channel.hpp has the mechanism): offered during the
// Hello exchange, never assumed, and never in the way: until it is set up, and whenever it cannot be, the connection
// carries everything on TCP. CUDA IPC (src/memory/cuda_ipc.hpp) rides on it: agreed in the same exchange, attached with the
// channel, its IpcDone frames handled here.
#include <cstdlib>

#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"
#include "core/log.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc {

namespace {
// Hands a channel to the connection, if it is still there, with the CUDA IPC link the pair agreed to (if any) first:
// the channel's set-up is what lets either side send, and whatever it sends may be lent.
auto install_on(const std::shared_ptr<detail::Connection>& conn, std::shared_ptr<detail::CudaIpcLink> ipc) {
  return [weak = std::weak_ptr(conn), ipc = std::move(ipc)](std::shared_ptr<detail::ShmChannel> channel) {
    auto c = weak.lock();
    if (!c) return;
    if (ipc) c->attach_cuda_ipc(ipc);
    c->attach_shm(std::move(channel));
  };
}
}  // namespace

void Runtime::Impl::start_same_host() {
  if (!options.same_host_channel) return;
  same_host_id = detail::same_host_identity();
  if (same_host_id.empty()) return same_host_failed(-1, "cannot read this host's boot id and network namespace");
  cuda_ipc_offered = options.cuda_ipc && detail::cuda::ipc_capable();
  try {
    shm_listener = std::make_unique<detail::ShmListener>(main_io(), self.name);
  } catch (const std::exception& e) {
    // We can still dial peers' channels; only the connections others dial to us stay on TCP.
    same_host_failed(-1, std::string("cannot listen on a Unix socket: ") + e.what());
  }
}

// Acceptor: a peer on our host gets the name of our Unix socket and a cookie, in our answer on the authenticated
// connection; presenting the cookie's claim (channel_claim: only the two ends can make it) there with a segment is
// what attaches the segment to this connection.
void Runtime::Impl::offer_same_host(const std::shared_ptr<detail::Connection>& conn, const detail::Hello& theirs,
                                    detail::Hello& answer) {
  if (!shm_listener || same_host_id.empty() || theirs.host != same_host_id) return;
  answer.shm_socket = shm_listener->name();
  answer.shm_cookie = shm_listener->offer(
      install_on(conn, cuda_ipc_link(conn->peer_rank, theirs.cuda_ipc, theirs.host)),
      [weak = std::weak_ptr(conn)] { return !weak.expired(); },
      [&](const std::string& cookie) {
        return detail::channel_claim(auth.secret, conn->handshake_transcript(), cookie);
      });
}

// Dialer: the peer's answer offered a channel and says it is on our host. The set-up (a segment, a Unix socket, a
// message each way) is left until the first large message crosses the connection: most pairs of a large job never
// exchange one, and setting theirs up made a new connection cost ~1.6x as much. With CUDA IPC agreed it starts at once:
// CUDA tensors are lent only once the channel is up, and none should go through host memory while it is not.
// Either way it holds nothing up: it runs on the connection's I/O thread, and until it is done the connection carries
// everything on TCP.
void Runtime::Impl::dial_same_host(const std::shared_ptr<detail::Connection>& conn, const detail::Hello& answer) {
  if (same_host_id.empty() || answer.host != same_host_id || answer.shm_cookie.empty()) return;
  const int rank = conn->peer_rank;
  auto ipc = cuda_ipc_link(rank, answer.cuda_ipc, answer.host);
  const bool at_once = ipc != nullptr;
  // Not the cookie itself: a process on the path may have read it (channel_claim).
  auto set_up = [this, rank, io = &conn->io(), socket = answer.shm_socket,
                 cookie = detail::channel_claim(auth.secret, conn->handshake_transcript(), answer.shm_cookie),
                 install = install_on(conn, std::move(ipc))] {
    asio::co_spawn(
        *io,
        [this, rank, socket, cookie, install]() -> asio::awaitable<void> {
          const std::string failure = co_await detail::dial_shm_channel(socket, cookie, options.same_host_ring_bytes,
                                                                        install, options.handshake_timeout);
          if (!failure.empty()) same_host_failed(rank, failure);
          else detail::log(detail::LogLevel::debug, self.name, "same-host channel", "set up to rank {}", rank);
        },
        asio::detached);
  };
  if (at_once) set_up();
  else conn->set_up_shm_when_needed(std::move(set_up));
}

void Runtime::Impl::same_host_failed(int rank, const std::string& why) {
  const auto level = same_host_warned.exchange(true) ? detail::LogLevel::info : detail::LogLevel::warn;
  detail::log(level, self.name, "same-host channel", "{}{}; tensors go by TCP (further failures are logged at info)",
              rank >= 0 ? "none to rank " + std::to_string(rank) + ": " : std::string(), why);
}

std::shared_ptr<detail::CudaIpcLink> Runtime::Impl::cuda_ipc_link(int rank, bool theirs,
                                                                  const std::string& their_host) {
  if (!detail::cuda_ipc_agreed(cuda_ipc_offered, same_host_id, theirs, their_host)) return nullptr;
  return std::make_shared<detail::CudaIpcLink>([this, rank](const std::string& why) { cuda_ipc_failed(rank, why); });
}

void Runtime::Impl::cuda_ipc_failed(int rank, const std::string& why) {
  const auto level = cuda_ipc_warned.exchange(true) ? detail::LogLevel::info : detail::LogLevel::warn;
  detail::log(level, self.name, "CUDA IPC",
              "with rank {}: {}; CUDA tensors go through host memory (further failures "
              "are logged at info)",
              rank, why);
}

// An IpcDone frame: the peer is done with tensors we lent it. The lender's side: the I/O thread of the connection
// the tensors were lent on. The tensors are released here.
void detail::route_ipc_done(FrameDispatcher& frames) {
  frames.on(Route::ipc_done, [](const std::shared_ptr<Connection>& conn, Message&& msg) {
    auto link = conn->cuda_ipc();
    if (!link) return conn->close("protocol error: IpcDone on a connection without CUDA IPC");
    IpcDone done;
    try {
      done = decode_ipc_done(msg.body.data(), msg.body.size());
    } catch (const ProtocolError& e) {
      return conn->close(std::string("protocol error: ") + e.what());
    }
    if (done.stop_lending) link->lending_failed("the peer could not map a tensor lent to it", /*for_good=*/true);
    link->returned(done.ids);
  });
}

// The borrower's side, once the copies out of the lender's memory are done (or failed): on the same connection, so
// that the lender hears it from the peer it lent to, and before the message is delivered.
void Runtime::Impl::return_ipc_loans(const std::shared_ptr<detail::Connection>& conn,
                                     const detail::CudaIpcArrivals& arrivals) {
  if (!arrivals.link || arrivals.link->closed()) return;  // the lender released them with the connection
  detail::Message m;
  m.head.kind = detail::FrameKind::IpcDone;
  m.body = detail::encode_ipc_done({arrivals.link->ask_peer_to_stop(), arrivals.ids()});
  conn->send(detail::prepare(std::move(m)));
}

}  // namespace corpc
