// Connections from peers on this host over an abstract Unix socket instead of TCP. The stream, the handshake and
// everything after it are the same; what differs is the kernel's path: no TCP state machine, no loopback softirq,
// so a new connection costs ~0.6x as much and a small call's round trip ~0.8x (docs/benchmarks.md). A dialer uses it
// when the world table (or a rejoined rank's Hello) says the peer is on its host, and TCP when the socket is not there
// or refuses it (a full backlog: a Unix connect does not wait).
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "core/log.hpp"
#include "rpc/runtime_impl.hpp"
#include "transport/abstract_socket.hpp"
#include "transport/shm_channel.hpp"

namespace corpc {

void Runtime::Impl::start_local_listener() {
  // With TLS every connection carries it, as the peers expect.
  if (!options.same_host_socket || options.tls) return;
  const std::string& host = detail::same_host_identity();
  if (host.empty()) return;  // no boot id or namespace to compare: nobody could tell it is on our host
  std::string name;
  try {
    local_acceptor.emplace(main_io());
    name = detail::listen_abstract(*local_acceptor, "corpc-rpc");
    // local_accept_loop accepts with accept4 until EAGAIN, so the listening socket itself must not block. Asio up to
    // 1.30 happened to set O_NONBLOCK on a socket it waited on; 1.36 (Debian testing) does not, and the I/O thread
    // then blocked in accept4 with the next dialer's handshake waiting on that same thread.
    local_acceptor->non_blocking(true);
  } catch (const std::exception& e) {
    local_acceptor.reset();
    detail::log(detail::LogLevel::info, self.name, "rendezvous",
                "peers on this host connect over TCP: cannot listen on a Unix socket: {}", e.what());
    return;
  }
  local = {host, std::move(name)};
}

// Accepts all that are waiting at each wake-up; each accepted socket goes to an I/O thread as a TCP one would.
void Runtime::Impl::local_accept_loop() {
  if (!local_acceptor) return;
  local_acceptor->async_wait(asio::socket_base::wait_read, [this](const asio::error_code& ec) {
    if (ec == asio::error::operation_aborted || !local_acceptor->is_open()) return;
    for (;;) {
      const int fd = ::accept4(local_acceptor->native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
        // A descriptor limit, say: the TCP listener's pause, not a busy loop.
        accept_errors++;
        auto pause = std::make_shared<asio::steady_timer>(main_io(), std::chrono::milliseconds(10));
        pause->async_wait([this, pause](const asio::error_code&) { local_accept_loop(); });
        return;
      }
      asio::ip::tcp::socket socket(pick_io());
      asio::error_code adopted;
      socket.assign(asio::ip::tcp::v4(), fd, adopted);
      if (adopted) {
        ::close(fd);
        continue;
      }
      accepted++;
      serve_accepted(std::move(socket), "127.0.0.1", 0);
    }
    local_accept_loop();
  });
}

}  // namespace corpc
