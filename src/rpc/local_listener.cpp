// The same-host listener (local_listener.hpp).
#include "rpc/local_listener.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <memory>

#include "core/log.hpp"
#include "transport/abstract_socket.hpp"
#include "transport/shm_channel.hpp"

namespace corpc::detail {

void LocalListener::start(Host& host, asio::io_context& io, const std::string& worker) {
  host_ = &host;
  const std::string& this_host = same_host_identity();
  if (this_host.empty()) return;  // no boot id or namespace to compare: nobody could tell it is on our host
  std::string name;
  try {
    acceptor_.emplace(io);
    name = listen_abstract(*acceptor_, "corpc-rpc");
    // accept() accepts with accept4 until EAGAIN, so the listening socket itself must not block. Asio up to 1.30
    // happened to set O_NONBLOCK on a socket it waited on; 1.36 (Debian testing) does not, and the I/O thread then
    // blocked in accept4 with the next dialer's handshake waiting on that same thread.
    acceptor_->non_blocking(true);
  } catch (const std::exception& e) {
    acceptor_.reset();
    log(LogLevel::info, worker, "rendezvous", "peers on this host connect over TCP: cannot listen on a Unix socket: {}",
        e.what());
    return;
  }
  address_ = {this_host, std::move(name)};
}

// Each accepted socket goes to an I/O thread as a TCP one would.
void LocalListener::accept() {
  if (!acceptor_) return;
  acceptor_->async_wait(asio::socket_base::wait_read, [this](const asio::error_code& ec) {
    if (ec == asio::error::operation_aborted || !acceptor_->is_open()) return;
    for (;;) {
      const int fd = ::accept4(acceptor_->native_handle(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) break;
        // A descriptor limit, say: the TCP listener's pause, not a busy loop.
        host_->local_accept_failed();
        auto pause = std::make_shared<asio::steady_timer>(acceptor_->get_executor(), std::chrono::milliseconds(10));
        pause->async_wait([this, pause](const asio::error_code&) { accept(); });
        return;
      }
      asio::ip::tcp::socket socket(host_->pick_io());
      asio::error_code adopted;
      socket.assign(asio::ip::tcp::v4(), fd, adopted);
      if (adopted) {
        ::close(fd);
        continue;
      }
      host_->serve_local(std::move(socket));
    }
    accept();
  });
}

void LocalListener::close() {
  asio::error_code ec;
  if (acceptor_) acceptor_->close(ec);
}

}  // namespace corpc::detail
