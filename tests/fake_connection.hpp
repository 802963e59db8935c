// A fake connection for in-process unit tests of the runtime's tables and of what drives them: a Connection that holds
// only what the tables read (its peer's rank, its address) and sends nothing. It records instead what
// it was asked to do: every frame sent, in order, and the first close with its reason (close_when_flushed is not
// recorded). The record has no lock: a test reads it once the threads that send or close on it are done.
#pragma once

#include <asio.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../src/transport/connection.hpp"

namespace corpc::test {

class TableConnection final : public detail::Connection {
 public:
  // `make_session`: the upper layer's state on it (a call engine, with the direction), as the runtime's connections
  // carry; none by default.
  TableConnection(asio::io_context& io, std::string address, const detail::SessionFactory& make_session = {})
      : Connection(io, make_session) {
    remote_address = std::move(address);
  }
  void send(detail::OutFrame&& frame) override { sent.push_back(std::move(frame)); }
  void close(std::string why) override {
    if (closed) return;
    closed = true;
    closed_why = std::move(why);
  }
  void close_when_flushed() override {}
  // While on, frames handed to the dispatcher read as requests whose bytes the transport dropped for their size.
  void deliver_refused(bool on) noexcept { delivering_refused_ = on; }

  std::vector<detail::OutFrame> sent;  // every frame sent, in order
  std::string closed_why;              // the reason given by the first close
  bool closed = false;
};

inline std::shared_ptr<detail::Connection> table_connection(asio::io_context& io, std::string address,
                                                            const detail::SessionFactory& make_session = {}) {
  return std::make_shared<TableConnection>(io, std::move(address), make_session);
}

}  // namespace corpc::test
