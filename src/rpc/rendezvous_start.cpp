// The runtime's side of the rendezvous (rendezvous.hpp has the rest): listen, register with rank 0, wait for the world
// table. Every rank registers with rank 0, which answers with the full table once all are there. Ranks may start in
// any order: the others retry reaching rank 0 until RpcOptions::init_timeout.
#include "corpc/rpc/call.hpp"

#include "core/log.hpp"
#include "memory/cuda_transfer.hpp"
#include "rpc/error_frames.hpp"
#include "rpc/hello.hpp"
#include "rpc/runtime_impl.hpp"
#include "wire/device_map.hpp"

namespace corpc {

namespace {

// The loopback address `host` names (a literal such as 127.0.0.2 or ::1, or a name that resolves only to loopback
// addresses), or empty if it names anything else: a job whose rank 0 is on loopback stays on loopback.
std::string loopback_address_of(asio::io_context& io, const std::string& host) {
  asio::error_code ec;
  auto literal = asio::ip::make_address(host, ec);
  if (!ec) return literal.is_loopback() ? literal.to_string() : std::string();
  asio::ip::tcp::resolver resolver(io);
  auto results = resolver.resolve(host, "", ec);
  if (ec || results.empty()) return {};
  for (const auto& r : results)
    if (!r.endpoint().address().is_loopback()) return {};
  return results.begin()->endpoint().address().to_string();
}

// Opens `acceptor` on `host`:`port` (0: any), or takes `listen_fd`, a socket a launcher (corpc::launch_processes) bound
// and listens on for us, so that no other process could take the port in between. Returns the port. `port_source`:
// where a port chosen before this process started came from (rank 0's), for the error when another process holds it.
std::uint16_t open_listener(asio::ip::tcp::acceptor& acceptor, const std::string& host, std::uint16_t port,
                            int listen_fd, const std::string& port_source) {
  if (listen_fd >= 0) {
    acceptor.assign(asio::ip::tcp::v4(), listen_fd);
    return acceptor.local_endpoint().port();
  }
  asio::ip::tcp::resolver resolver(acceptor.get_executor());
  auto endpoint = *resolver.resolve(host, std::to_string(port)).begin();
  acceptor.open(endpoint.endpoint().protocol());
  acceptor.set_option(asio::ip::tcp::acceptor::reuse_address(true));
  try {
    acceptor.bind(endpoint);
  } catch (const std::system_error& e) {
    std::string why = "cannot listen on " + host + ":" + std::to_string(endpoint.endpoint().port()) + ": " + e.what();
    // torchrun's agent picks a free port, closes it and hands it on, so on a busy host another process can take it
    // before rank 0 binds it.
    if (!port_source.empty() && e.code() == asio::error::address_in_use) {
      why += " (rank 0's address, from " + port_source +
             "): another process holds that port; under torchrun, whose agent chose a free port and released it "
             "before this rank could bind it, run again or pass --master_port";
    }
    throw ConnectionError(why);
  }
  acceptor.listen();
  return acceptor.local_endpoint().port();
}

// A rank's registration with rank 0, as init_rpc waits for it: whether a connection was made, and the last reason
// one was not (any thread may ask; the dial runs on the main I/O thread).
class RankZeroDial {
 public:
  void failed(std::string why) {
    std::lock_guard lock(mutex_);
    last_failure_ = std::move(why);
  }
  void connected() {
    std::lock_guard lock(mutex_);
    connected_ = true;
  }
  // What init_rpc says when the world table did not come in time.
  std::string why_not(const Runtime::Impl::MasterAddress& master, std::chrono::milliseconds timeout) const {
    std::lock_guard lock(mutex_);
    const std::string within = " within the init timeout (" + std::to_string(timeout.count()) +
                               " ms: RpcOptions::init_timeout, CORPC_INIT_TIMEOUT_MS)";
    if (connected_) return "init_rpc: workers did not all arrive" + within + " (no answer from rank 0)";
    return "could not reach rank 0 at " + master.host + ":" + std::to_string(master.port) + " (" + master.source + ")" +
           within + (last_failure_.empty() ? "" : ": " + last_failure_);
  }

 private:
  mutable std::mutex mutex_;
  bool connected_ = false;
  std::string last_failure_;
};

// Dials rank 0 until it answers the handshake or `deadline` passes, then sends our registration (a Hello). Rank 0 not
// listening yet is retried every 50 ms; a handshake that stalls, three times in all; a refusal (another secret) ends
// the rendezvous at once.
asio::awaitable<void> register_with_rank_zero(Runtime::Impl& rt, Runtime::Impl::MasterAddress master,
                                              std::chrono::steady_clock::time_point deadline,
                                              std::shared_ptr<RankZeroDial> dial) {
  asio::io_context& io = rt.main_io();
  asio::steady_timer pause(io);
  int interrupted = 0;  // handshakes with rank 0 that stalled or broke off
  for (;;) {
    detail::Transport transport{asio::ip::tcp::socket(io)};
    std::string failure;
    std::string address;  // rank 0's, as connected: the connection need not ask the socket
    try {
      asio::ip::tcp::resolver resolver(io);
      const std::string port = std::to_string(master.port);
      auto endpoints = co_await resolver.async_resolve(master.host, port, asio::use_awaitable);
      auto connected = co_await asio::async_connect(transport.socket(), endpoints, asio::use_awaitable);
      address = connected.address().to_string();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    if (failure.empty()) {
      std::string refused;
      try {
        co_await detail::authenticate(transport, rt.auth, detail::AuthRole::dialer);
      } catch (const detail::HandshakeInterrupted& e) {
        // A rank 0 too busy to answer within the handshake timeout (or one that gave up on us for that reason) is
        // tried again on a fresh connection: three handshakes in all, as a dial has (tcp_dial.cpp).
        if (++interrupted < 3) failure = e.what();
        else refused = std::string(e.what()) + " (3 attempts)";
      } catch (const std::exception& e) {
        refused = e.what();
      }
      if (!refused.empty()) {  // a different secret does not get better by retrying
        rt.rendezvous->world_ready().set_exception(ConnectionError(
            "rank 0 at " + master.host + ":" + std::to_string(master.port) + " refused us: " + refused));
        co_return;
      }
    }
    if (!failure.empty()) {
      dial->failed(failure);
      if (std::chrono::steady_clock::now() >= deadline) {
        rt.rendezvous->world_ready().set_exception(TimeoutError(dial->why_not(master, rt.options.init_timeout)));
        co_return;
      }
      pause.expires_after(std::chrono::milliseconds(50));
      co_await pause.async_wait(asio::use_awaitable);
      continue;
    }
    dial->connected();
    auto conn = detail::make_tcp_connection(std::move(transport), rt.connection_settings(/*dialed=*/true),
                                            rt.frame_handler(), rt.close_handler(), std::move(address));
    conn->peer_rank = 0;
    rt.peers->set_outgoing(0, conn);
    conn->send(detail::prepare(hello_message(rt.rendezvous->our_hello(true))));
    co_return;
  }
}

}  // namespace

void Runtime::Impl::start_rendezvous(const MasterAddress& master, int listen_fd) {
  std::string listen_host = options.listen_address;
  if (listen_host.empty()) {
    listen_host = loopback_address_of(main_io(), master.host);
    if (listen_host.empty()) listen_host = "0.0.0.0";
  }
  // Rank 0 listens where everyone finds it (a launcher may have bound the port for it: `listen_fd`); the others on a
  // port the system picks.
  self.port = self.rank == 0 ? open_listener(*acceptor, listen_host, master.port, listen_fd, master.source)
                             : open_listener(*acceptor, listen_host, 0, -1, "");
  // Rank 0 is where everyone found it. The others: the address they listen on if it is a specific one, else the
  // address rank 0 sees them at (filled in there).
  const bool specific = listen_host != "0.0.0.0" && listen_host != "::";
  self.host = self.rank == 0 ? master.host : specific ? listen_host : "";
  // Before our registration: it carries where peers on our host connect to us. With TLS every connection carries it,
  // as the peers expect.
  if (options.same_host_socket && !options.tls) local_listener.start(*local_host, main_io(), self.name);
  if (self.rank == 0) {
    // Registered before accepting anyone: a worker's registration may be processed the moment we accept it.
    rendezvous->register_self(self, local_listener.address());
  }
  // From here on the I/O threads may read `self`, and on_world fills in its host: this thread reads only its own copy
  // of the rank.
  const int my_rank = self.rank;
  same_host.start(main_io(), {.channel = options.same_host_channel,
                              .cuda_ipc = options.cuda_ipc,
                              .ring_bytes = options.same_host_ring_bytes,
                              .handshake_timeout = options.handshake_timeout,
                              .secret = auth.secret,
                              .worker = self.name});
  asio::post(main_io(), [this] {
    accept_loop();
    local_listener.accept();
    if (self.rank == 0) rendezvous->publish_if_complete();  // a world of one
  });

  const auto deadline = std::chrono::steady_clock::now() + options.init_timeout;
  auto dial = std::make_shared<RankZeroDial>();
  if (my_rank != 0) asio::co_spawn(main_io(), register_with_rank_zero(*this, master, deadline, dial), asio::detached);

  auto ready = rendezvous->world_ready().get_future();
  try {
    ready.wait(options.init_timeout + std::chrono::milliseconds(200));
  } catch (const TimeoutError&) {
    if (my_rank != 0) throw TimeoutError(dial->why_not(master, options.init_timeout));
    throw TimeoutError("init_rpc: workers did not all arrive within " + std::to_string(options.init_timeout.count()) +
                       " ms (missing ranks: " + rendezvous->registrations().missing(world_size) + "; " +
                       std::to_string(accepted.load()) + " connections accepted, " +
                       std::to_string(accept_errors.load()) + " accept errors, " +
                       std::to_string(refused_connections.load()) + " refused by the handshake)");
  }
}

}  // namespace corpc
