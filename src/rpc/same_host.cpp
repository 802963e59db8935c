// The same-host channel's and CUDA IPC's set-up between two workers (same_host.hpp). CUDA IPC rides on the channel:
// agreed in the same exchange, attached with the channel, its IpcDone frames handled here.
#include "rpc/same_host.hpp"

#include "core/log.hpp"
#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"
#include "transport/rank_identity.hpp"
#include "transport/shm_channel.hpp"

namespace corpc::detail {

namespace {
// Hands a channel to the connection, if it is still there, with the CUDA IPC link the pair agreed to (if any) first:
// the channel's set-up is what lets either side send, and whatever it sends may be lent.
auto install_on(const std::shared_ptr<Connection>& conn, std::shared_ptr<CudaIpcLink> ipc) {
  return [weak = std::weak_ptr(conn), ipc = std::move(ipc)](std::shared_ptr<ShmChannel> channel) {
    auto c = weak.lock();
    if (!c) return;
    if (ipc) c->attach_cuda_ipc(ipc);
    c->attach_shm(std::move(channel));
  };
}
}  // namespace

SameHost::SameHost() = default;
SameHost::~SameHost() = default;

void SameHost::start(asio::io_context& io, Settings settings) {
  settings_ = std::move(settings);
  if (!settings_.channel) return;
  host_id_ = same_host_identity();
  if (host_id_.empty()) return failed(-1, "cannot read this host's boot id and network namespace");
  cuda_ipc_offered_ = settings_.cuda_ipc && cuda::ipc_capable();
  try {
    listener_ = std::make_unique<ShmListener>(io, settings_.worker);
  } catch (const std::exception& e) {
    // We can still dial peers' channels; only the connections others dial to us stay on TCP.
    failed(-1, std::string("cannot listen on a Unix socket: ") + e.what());
  }
}

std::string SameHost::socket_name() const { return listener_ ? listener_->name() : std::string(); }

void SameHost::close() {
  if (listener_) listener_->close();
}

// Presenting the cookie's claim (channel_claim: only the two ends of this connection can make it) on our Unix socket,
// with a segment, is what attaches the segment to this connection.
void SameHost::offer(const std::shared_ptr<Connection>& conn, const Hello& theirs, Hello& answer) {
  if (!listener_ || host_id_.empty() || theirs.host != host_id_) return;
  answer.shm_socket = listener_->name();
  answer.shm_cookie = listener_->offer(
      install_on(conn, cuda_ipc_link(conn->peer_rank, theirs.cuda_ipc, theirs.host)),
      [weak = std::weak_ptr(conn)] { return !weak.expired(); },
      [&](const std::string& cookie) { return channel_claim(settings_.secret, conn->handshake_transcript(), cookie); });
}

// The set-up (a segment, a Unix socket, a message each way) is left until the first large message crosses the
// connection: most pairs of a large job never exchange one, and setting theirs up made a new connection cost ~1.6x as
// much. With CUDA IPC agreed it starts at once: CUDA tensors are lent only once the channel is up, and none should go
// through host memory while it is not. Either way it holds nothing up: it runs on the connection's I/O thread, and
// until it is done the connection carries everything on TCP.
void SameHost::dial(const std::shared_ptr<Connection>& conn, const Hello& answer) {
  if (host_id_.empty() || answer.host != host_id_ || answer.shm_cookie.empty()) return;
  const int rank = conn->peer_rank;
  auto ipc = cuda_ipc_link(rank, answer.cuda_ipc, answer.host);
  const bool at_once = ipc != nullptr;
  // Not the cookie itself: a process on the path may have read it (channel_claim).
  auto set_up = [this, rank, io = &conn->io(), socket = answer.shm_socket,
                 cookie = channel_claim(settings_.secret, conn->handshake_transcript(), answer.shm_cookie),
                 install = install_on(conn, std::move(ipc))] {
    asio::co_spawn(
        *io,
        [this, rank, socket, cookie, install]() -> asio::awaitable<void> {
          const std::string failure =
              co_await dial_shm_channel(socket, cookie, settings_.ring_bytes, install, settings_.handshake_timeout);
          if (!failure.empty()) failed(rank, failure);
          else log(LogLevel::debug, settings_.worker, "same-host channel", "set up to rank {}", rank);
        },
        asio::detached);
  };
  if (at_once) set_up();
  else conn->set_up_shm_when_needed(std::move(set_up));
}

void SameHost::failed(int rank, const std::string& why) {
  const auto level = warned_.exchange(true) ? LogLevel::info : LogLevel::warn;
  log(level, settings_.worker, "same-host channel", "{}{}; tensors go by TCP (further failures are logged at info)",
      rank >= 0 ? "none to rank " + std::to_string(rank) + ": " : std::string(), why);
}

std::shared_ptr<CudaIpcLink> SameHost::cuda_ipc_link(int rank, bool theirs, const std::string& their_host) {
  if (!cuda_ipc_agreed(cuda_ipc_offered_, host_id_, theirs, their_host)) return nullptr;
  return std::make_shared<CudaIpcLink>([this, rank](const std::string& why) { cuda_ipc_failed(rank, why); });
}

void SameHost::cuda_ipc_failed(int rank, const std::string& why) {
  const auto level = cuda_ipc_warned_.exchange(true) ? LogLevel::info : LogLevel::warn;
  log(level, settings_.worker, "CUDA IPC",
      "with rank {}: {}; CUDA tensors go through host memory (further failures "
      "are logged at info)",
      rank, why);
}

// The lender's side: the I/O thread of the connection the tensors were lent on. The tensors are released here.
void route_ipc_done(FrameDispatcher& frames) {
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
void return_ipc_loans(const std::shared_ptr<Connection>& conn, const CudaIpcArrivals& arrivals) {
  if (!arrivals.link || arrivals.link->closed()) return;  // the lender released them with the connection
  Message m;
  m.head.kind = FrameKind::IpcDone;
  m.body = encode_ipc_done({arrivals.link->ask_peer_to_stop(), arrivals.ids()});
  conn->send(prepare(std::move(m)));
}

}  // namespace corpc::detail
