// Connections and peers: dialing, accepting, closing, and what a peer's death does.
#include <algorithm>
#include <thread>

#include "core/log.hpp"
#include "memory/host_allocator.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc {

std::function<void(const std::shared_ptr<detail::Connection>&, detail::Message&&)> Runtime::Impl::frame_handler() {
  return
      [this](const std::shared_ptr<detail::Connection>& c, detail::Message&& m) { frames.dispatch(c, std::move(m)); };
}
std::function<void(const std::shared_ptr<detail::Connection>&, const std::string&)> Runtime::Impl::close_handler() {
  return [this](const std::shared_ptr<detail::Connection>& c, const std::string& why) { on_close(c, why); };
}

void Runtime::Impl::init_flow_control() {
  receive_budget =
      std::make_unique<detail::ReceiveBudget>(options.receive_budget_per_process, options.max_requests_held);
  // Announced in our Hello: senders refuse what we could never hold, instead of it waiting here for ever.
  options.limits.max_request_bytes = std::min(
      {options.limits.max_request_bytes, options.receive_budget_per_connection, options.receive_budget_per_process});
  detail::configure_host_memory_defaults();  // unless the program configured the process's host memory itself
}

detail::ConnectionSettings Runtime::Impl::connection_settings(bool dialed) const {
  detail::ConnectionSettings s;
  s.limits = options.limits;
  s.budget = receive_budget.get();
  s.budget_per_connection = options.receive_budget_per_connection;
  s.max_write_backlog = options.max_write_backlog_bytes;
  s.liveness_timeout = options.liveness_timeout;
  s.make_session = detail::CallEngine::factory(*call_host, options.max_calls_in_flight_per_peer, dialed);
  return s;
}

std::shared_ptr<detail::Connection> Runtime::Impl::connection_to(int rank) {
  return peers->outgoing_to(rank, workers[rank].name, [&](const detail::PeerTable::Address* moved) {
    std::shared_ptr<detail::Connection> c;
    if (rank == self.rank) {
      c = detail::make_loopback_connection(
          pick_io(), options.limits, frame_handler(),
          detail::CallEngine::factory(*call_host, options.max_calls_in_flight_per_peer, /*dialed=*/true));
      c->peer_rank = rank;
    } else {
      // peer_rank is set by the dialer before the dial starts, and the direction when its session is made: from then
      // on the connection's I/O thread reads them (the peer's Hello answer), so writing them here would race with it.
      const std::string& host = moved ? moved->host : workers[rank].host;
      const std::uint16_t port = moved ? moved->port : workers[rank].port;
      // A peer on our host is dialed on its Unix socket (local_listener.cpp), if it has one.
      std::string local_socket;
      if (options.same_host_socket && !options.tls) {
        const detail::LocalAddress* theirs = moved ? &moved->local : nullptr;
        if (!theirs && rank < static_cast<int>(local_addresses.size())) theirs = &local_addresses[rank];
        if (theirs && !theirs->host.empty() && theirs->host == detail::same_host_identity())
          local_socket = theirs->socket;
      }
      // Every dialed connection starts with who we are and what we accept, signed for this connection; what we send
      // after it waits for the answer to prove that the peer is the rank we dialled (on_hello).
      c = detail::dial_tcp_connection(
          pick_io(), rank, host, port, std::move(local_socket), connection_settings(/*dialed=*/true), frame_handler(),
          close_handler(), auth, [this, rank](const std::string& transcript) {
            return detail::prepare(hello_message(rendezvous->our_hello(false, rank, transcript)));
          });
    }
    return c;
  });
}

void Runtime::Impl::fail_all_calls(std::exception_ptr error) {
  for (auto& c : peers->outgoing_connections()) detail::CallEngine::of(*c).closed(error);
}

namespace detail {
// A Goodbye's body says the peer stops after an error; on_close words its departure with it. Bounded: it is only words.
void route_goodbye(FrameDispatcher& frames, PeerTable& peers) {
  frames.on(Route::goodbye, [&peers](const std::shared_ptr<Connection>& conn, Message&& msg) {
    if (!msg.body.empty()) peers.set_farewell(conn->peer_rank, msg.body.substr(0, 4096));
  });
}
}  // namespace detail

void Runtime::Impl::mark_dead(int rank, const std::string& why) {
  std::vector<std::function<void(int, const std::string&)>> listeners;
  auto ours = peers->mark_dead(rank, why);
  if (!ours) return;  // known already
  // Whichever direction noticed first: our calls to it fail now, not when our own connection notices too.
  if (*ours) (*ours)->close(why);
  {
    std::lock_guard lock(hooks_mutex);
    listeners = failure_listeners;
  }
  for (auto& l : listeners) l(rank, why);
  graceful->check_rounds();
}

void Runtime::Impl::on_close(const std::shared_ptr<detail::Connection>& conn, const std::string& why) {
  const int rank = conn->peer_rank;
  // Only the loss of a connection that speaks for the rank is the rank's: a refused claimant's is its own.
  const auto loss = peers->remove(conn);
  const bool was_closing = loss.while_closing;
  std::string reason = why;
  const detail::RpcSession& session = detail::RpcSession::of(*conn);
  if (session.said_goodbye) {
    const auto farewell = peers->farewell(rank);
    reason = farewell.empty() ? std::string(detail::GracefulShutdown::kShutDownReason)
                              : "it stopped after an error: " + farewell;
  }
  // The death is recorded before anyone learns of it through a failed call: a caller woken by that failure (e.g.
  // shutdown() on a worker whose master died) must find the rank already dead.
  // An answer we refused (an impostor at the rank's address) says nothing of the rank itself.
  const bool impostor = session.outgoing && session.hello_refused;
  const bool world_known = rendezvous->world().known();
  if (world_known && rank >= 0 && loss.speaks_for_rank && !was_closing && !impostor) mark_dead(rank, reason);
  // Our requests on this connection cannot be answered any more, whatever the reason.
  const std::string who = "worker '" + name_of(rank) + "' (rank " + std::to_string(rank) + ")";
  auto error = was_closing ? std::make_exception_ptr(ShutdownError("corpc runtime shut down"))
               : impostor  ? std::make_exception_ptr(ConnectionError("cannot reach " + who + ": " + reason))
                           : std::make_exception_ptr(ConnectionError(who + " is gone: " + reason));
  detail::CallEngine::of(*conn).closed(error);
  if (!world_known) {
    if (self.rank == 0) {
      rendezvous->registrations().forget(conn);  // a worker that left before the world was complete may come back
    } else if (session.outgoing && rank == 0) {
      rendezvous->world_ready().set_exception(ConnectionError("lost rank 0 during rendezvous: " + why));
    }
    return;
  }
}

void Runtime::Impl::accept_loop() {
  // accept() fills in the peer's address: no getpeername later, for the log or the connection.
  auto from = std::make_shared<asio::ip::tcp::endpoint>();
  acceptor->async_accept(pick_io(), *from, [this, from](const asio::error_code& ec, asio::ip::tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor->is_open()) return;  // closed: shutting down
    if (ec) {
      // A transient failure (a client that reset before we accepted it, a descriptor limit) must not stop us
      // accepting for good: try again shortly.
      accept_errors++;
      auto pause = std::make_shared<asio::steady_timer>(main_io(), std::chrono::milliseconds(10));
      pause->async_wait([this, pause](const asio::error_code&) { accept_loop(); });
      return;
    }
    accepted++;
    accept_loop();
    serve_accepted(std::move(socket), from->address().to_string(), from->port());
  });
}

void Runtime::Impl::serve_accepted(asio::ip::tcp::socket socket, std::string address, std::uint16_t port) {
  // Nothing is read as a frame before the peer has proved it knows the secret; a failure is logged and changes
  // nothing else (no name is revealed, no rank is marked).
  auto& io = static_cast<asio::io_context&>(socket.get_executor().context());
  asio::co_spawn(
      io,
      [this, address = std::move(address), port, socket = std::move(socket)]() mutable -> asio::awaitable<void> {
        std::string refused;
        detail::Transport transport(std::move(socket));
        try {
          co_await detail::authenticate(transport, auth, detail::AuthRole::acceptor);
        } catch (const std::exception& e) {
          refused = e.what();
        }
        if (!refused.empty()) {
          refused_connections++;
          const std::string from = port ? fmt::format("{}:{}", address, port) : "this host (Unix socket)";
          refused_handshakes.refused(main_io(), self.name,
                                     fmt::format("refused a connection from {}: {}", from, refused));
          co_return;
        }
        auto conn = detail::make_tcp_connection(std::move(transport), connection_settings(/*dialed=*/false),
                                                frame_handler(), close_handler(), std::move(address));
        if (!peers->add_incoming(conn)) conn->close("shutting down");
      },
      asio::detached);
}

void Runtime::Impl::close_everything(bool say_goodbye, const std::string& failure) {
  const auto conns = peers->close();
  auto goodbye = [&] {
    detail::Message bye;
    bye.head.kind = detail::FrameKind::Goodbye;
    bye.body = failure;
    return detail::prepare(std::move(bye));
  };
  // A rank that stops after an error says so first: a peer whose call or shutdown round fails next must already
  // know why (it reads the Goodbye before that reply).
  if (say_goodbye && !failure.empty())
    for (auto& c : conns) c->send(goodbye());
  // Before any connection closes, so that calls in flight fail as shut down, not as lost peers.
  fail_all_calls(std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
  for (auto& w : replacement_waits.close())
    w.call.complete(w.call.target, w.call.dst, nullptr,
                    std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
  graceful->close_rounds();
  // While the threads still run (a stopped task resumes on them) and after its blocked calls have failed: after a
  // graceful shutdown the scope is empty already; otherwise its tasks unwind at their next await.
  graceful->join_background();
  for (auto& c : conns) {
    if (say_goodbye && failure.empty()) c->send(goodbye());
    c->close_when_flushed();
  }
  asio::post(main_io(), [this] {
    asio::error_code ec;
    acceptor->close(ec);
    same_host.close();
    local_listener.close();
  });
  // Give queued frames (replies, goodbyes) a moment to leave, then stop the I/O threads.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (;;) {
    if (!peers->any_open(self.rank)) break;
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  stop_threads();
}

}  // namespace corpc
