// Flow control of a TCP connection: a request is read only once its bytes fit in the receive budget (the process's
// and this connection's share), and while the connection's unsent output is below its bound; otherwise the reader
// pauses and TCP pushes back on the sender.
#include "transport/tcp_connection.hpp"

namespace corpc::detail {

void TcpConnection::release_receive(std::uint64_t bytes) noexcept {
  received_held_.fetch_sub(bytes);
  settings_.budget->give_back(bytes);  // wakes paused readers, this one included
}

// Reserves `need` bytes of the receive budget, pausing (reading nothing) until there is room and this
// connection's unsent output is below its bound.
asio::awaitable<void> TcpConnection::wait_for_room(std::uint64_t need) {
  for (;;) {
    const bool backlog_ok = backlog_.load(std::memory_order_relaxed) <= settings_.max_write_backlog;
    if (backlog_ok && try_reserve(need)) co_return;
    batch_end();  // what this thread owes goes out before it waits (the replies among it free room)
    if (backlog_ok) {
      settings_.budget->on_next_give_back([weak = std::weak_ptr(self())] {
        if (auto s = weak.lock()) asio::post(s->io(), [s] { s->room_timer_.cancel(); });
      });
      if (try_reserve(need)) co_return;
    }  // else flush_now wakes us when the backlog has gone
    paused_ = true;
    ++pauses_;
    room_timer_.expires_at(asio::steady_timer::time_point::max());
    asio::error_code ec;
    co_await room_timer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    paused_ = false;
    if (closed_) co_return;
  }
}

bool TcpConnection::try_reserve(std::uint64_t need) noexcept {
  if (received_held_.load() > settings_.budget_per_connection - need)
    return false;  // need <= the per-connection budget
  if (!settings_.budget->try_take(need)) return false;
  received_held_.fetch_add(need);
  return true;
}

}  // namespace corpc::detail
