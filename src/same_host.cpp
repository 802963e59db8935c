// The same-host channel's set-up between two workers (src/shm_channel.hpp has the mechanism): decided during the
// Hello exchange, never assumed, and never in the way: until it is set up, and whenever it cannot be, the connection
// carries everything on TCP.
#include <cstdlib>

#include "log.hpp"
#include "runtime_impl.hpp"

namespace corpc {

namespace {
bool channel_wanted(bool option) {
  const char* env = std::getenv("CORPC_SAME_HOST_CHANNEL");
  if (env && *env) return std::string(env) != "0";
  return option;
}

// Hands a channel to the connection, if it is still there.
auto install_on(const std::shared_ptr<detail::Connection>& conn) {
  return [weak = std::weak_ptr(conn)](std::shared_ptr<detail::ShmChannel> channel) {
    if (auto c = weak.lock()) c->attach_shm(std::move(channel));
  };
}
}  // namespace

void Runtime::Impl::start_same_host() {
  if (!channel_wanted(options.same_host_channel)) return;
  same_host_id = detail::same_host_identity();
  if (same_host_id.empty()) return same_host_failed(-1, "cannot read this host's boot id and network namespace");
  try {
    shm_listener = std::make_unique<detail::ShmListener>(main_io(), self.name);
  } catch (const std::exception& e) {
    // We can still dial peers' channels; only the connections others dial to us stay on TCP.
    same_host_failed(-1, std::string("cannot listen on a Unix socket: ") + e.what());
  }
}

// Acceptor: a peer on our host gets the name of our Unix socket and a cookie, in our answer on the authenticated
// connection; presenting that cookie there with a segment is what attaches the segment to this connection.
void Runtime::Impl::offer_same_host(const std::shared_ptr<detail::Connection>& conn, const detail::Hello& theirs,
                                    detail::Hello& answer) {
  if (!shm_listener || same_host_id.empty() || theirs.host != same_host_id) return;
  answer.shm_socket = shm_listener->name();
  answer.shm_cookie = shm_listener->offer(install_on(conn), [weak = std::weak_ptr(conn)] { return !weak.expired(); });
}

// Dialer: the peer's answer offered a channel and says it is on our host: set it up, without holding anything up.
void Runtime::Impl::dial_same_host(const std::shared_ptr<detail::Connection>& conn, const detail::Hello& answer) {
  if (same_host_id.empty() || answer.host != same_host_id || answer.shm_cookie.empty()) return;
  const int rank = conn->peer_rank;
  asio::co_spawn(conn->io(), [this, rank, answer, install = install_on(conn)]() -> asio::awaitable<void> {
    const std::string failure = co_await detail::dial_shm_channel(answer.shm_socket, answer.shm_cookie,
                                                                  options.same_host_ring_bytes, install,
                                                                  options.handshake_timeout);
    if (!failure.empty()) same_host_failed(rank, failure);
    else detail::log(detail::LogLevel::debug, self.name, "same-host channel", "set up to rank {}", rank);
  }, asio::detached);
}

void Runtime::Impl::same_host_failed(int rank, const std::string& why) {
  const auto level = same_host_warned.exchange(true) ? detail::LogLevel::info : detail::LogLevel::warn;
  detail::log(level, self.name, "same-host channel", "{}{}; tensors go by TCP (further failures are logged at info)",
              rank >= 0 ? "none to rank " + std::to_string(rank) + ": " : std::string(), why);
}

}  // namespace corpc
