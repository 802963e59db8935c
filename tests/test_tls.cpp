// TLS on every connection (RpcOptions::tls / CORPC_TLS_*): jobs over TLS, peers that must be refused, and what an
// observer on the wire sees. Certificates are made fresh for each test (tools/tls_certs.hpp).
#include <ATen/ATen.h>
#include <asio.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <doctest/doctest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "corpc/rref/rref.hpp"

#include "../tools/tls_certs.hpp"
#include "raw_peer.hpp"
#include "stopped_worker.hpp"
#include "support.hpp"

namespace test_tls {  // this file's names, apart from the files it shares an executable with

// The relay below is an Asio coroutine in a lambda: g++ 12 at -O1 inlines its frame's class-specific operator delete
// and reports it as mismatched with the operator new that made the frame, the same class's (a false positive).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

constexpr char kMarker[] = "CORPC-PLAINTEXT-MARKER-7f3a9c";

int add(int a, int b) { return a + b; }
at::Tensor echo_tensor(at::Tensor t) { return t; }
std::string echo_string(std::string s) { return s; }
at::Tensor arange(std::int64_t n) { return at::arange(n, at::kLong); }
std::string whoami() { return get_worker_info().name; }

// Coordination counters on rank 0 for tests that end without a graceful shutdown.
// Phase k counts the ranks that reached it.
std::atomic<int> g_reached[2]{};
void mark_reached(int phase) { ++g_reached[phase]; }
int reached(int phase) { return g_reached[phase].load(); }

RpcOptions tls_options(const TlsOptions& tls) {
  auto o = quick_options();
  o.tls = tls;
  o.handshake_timeout = 500ms * time_scale();
  return o;
}

// Bytes that are not all one value, so that a corrupted stretch cannot compare equal by chance.
at::Tensor pattern(std::int64_t n, int seed) {
  return at::arange(n, at::kFloat).mul_(0.37f).add_(static_cast<float>(seed)).sin_();
}

void setenv_tls(const TlsOptions& o) {
  ::setenv("CORPC_TLS_CERT", o.certificate_chain_file.c_str(), 1);
  ::setenv("CORPC_TLS_KEY", o.private_key_file.c_str(), 1);
  ::setenv("CORPC_TLS_CA", o.ca_file.c_str(), 1);
}

std::uint16_t free_port() {
  asio::io_context io;
  asio::ip::tcp::acceptor probe(io, {asio::ip::make_address("127.0.0.1"), 0});
  return probe.local_endpoint().port();
}

// A TCP relay on 127.0.0.1 that forwards each connection to `target_port` and keeps a copy of every byte it passes
// in both directions: what an observer on the network sees.
class TappingRelay {
 public:
  // A socket listening already, bound by the parent before its ranks were forked: no other process can take its port
  // in between, as one could between probing a free port and binding it.
  struct Listening {
    int fd;
  };
  explicit TappingRelay(std::uint16_t target_port)
      : acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}), target_(target_port) {
    start();
  }
  TappingRelay(std::uint16_t target_port, Listening listening)
      : acceptor_(io_, asio::ip::tcp::v4(), listening.fd), target_(target_port) {
    start();
  }
  ~TappingRelay() {
    io_.stop();
    thread_.join();
  }
  std::uint16_t port() const { return acceptor_.local_endpoint().port(); }
  std::string seen() {
    std::lock_guard lock(mutex_);
    return seen_;
  }
  // Waits until a connection has come and every one has ended in both directions.
  void wait_until_all_closed() {
    std::unique_lock lock(mutex_);
    quiet_.wait(lock, [&] { return relayed_ > 0 && open_pumps_ == 0; });
  }

 private:
  using Socket = std::shared_ptr<asio::ip::tcp::socket>;
  void start() {
    accept();
    thread_ = std::thread([this] { io_.run(); });
  }
  void accept() {
    acceptor_.async_accept([this](const asio::error_code& ec, asio::ip::tcp::socket s) {
      if (ec) return;
      connect(std::make_shared<asio::ip::tcp::socket>(std::move(s)), 0);
      accept();
    });
  }
  // The target may not listen yet (rank 1 can reach the relay before rank 0 is up): retry for a while.
  void connect(Socket client, int attempt) {
    auto server = std::make_shared<asio::ip::tcp::socket>(io_);
    server->async_connect({asio::ip::make_address("127.0.0.1"), target_}, [this, client, server,
                                                                           attempt](const asio::error_code& ec) {
      if (!ec) {
        {
          std::lock_guard lock(mutex_);
          ++relayed_;
          open_pumps_ += 2;
        }
        pump(client, server);
        pump(server, client);
      } else if (attempt < 500) {
        auto pause = std::make_shared<asio::steady_timer>(io_, 20ms);
        pause->async_wait([this, client, pause, attempt](const asio::error_code&) { connect(client, attempt + 1); });
      }
    });
  }
  void pump(Socket from, Socket to) {
    auto buf = std::make_shared<std::array<char, 65536>>();
    from->async_read_some(asio::buffer(*buf), [this, from, to, buf](const asio::error_code& ec, std::size_t n) {
      if (ec) {
        asio::error_code ignored;
        to->shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
        std::lock_guard lock(mutex_);
        if (--open_pumps_ == 0) quiet_.notify_all();
        return;
      }
      {
        std::lock_guard lock(mutex_);
        seen_.append(buf->data(), n);
      }
      asio::async_write(*to, asio::buffer(buf->data(), n),
                        [this, from, to, buf](const asio::error_code& ec, std::size_t) {
                          if (!ec) return pump(from, to);
                          std::lock_guard lock(mutex_);
                          if (--open_pumps_ == 0) quiet_.notify_all();
                        });
    });
  }

  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  std::uint16_t target_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable quiet_;
  std::string seen_;
  int relayed_ = 0, open_pumps_ = 0;
};

}  // namespace

TEST_CASE("a job over TLS: calls with tensors both ways, large transfers, remote and to_here") {
  ThrowawayPki pki;
  // One certificate per rank, from the environment (the launchers' way).
  const std::vector<TlsOptions> certs{pki.issue("rank0"), pki.issue("rank1"), pki.issue("rank2")};
  launch_processes(
      3,
      [&](int rank) {
        setenv_tls(certs[rank]);
        init_rpc(worker_name(rank), rank, 3, quick_options());
        for (int peer = 0; peer < 3; ++peer) {
          if (peer == rank) continue;
          EXPECT_EQ(rpc_sync<&whoami>(peer), worker_name(peer));
          // Small (parsed from the read buffer), and 6 MiB (read straight into its storage, many TLS records).
          for (std::int64_t n : {std::int64_t{1000}, std::int64_t{3} << 19}) {
            const at::Tensor t = pattern(n, rank * 10 + peer);
            const at::Tensor back = rpc_sync<&echo_tensor>(peer, t);
            EXPECT(back.nbytes() == t.nbytes() && std::memcmp(back.data_ptr(), t.data_ptr(), t.nbytes()) == 0);
          }
          std::vector<Future<int>> many;
          for (int i = 0; i < 200; ++i) many.push_back(rpc_async<&add>(peer, i, rank));
          for (int i = 0; i < 200; ++i) EXPECT_EQ(many[i].wait(30s), i + rank);
          RRef<at::Tensor> r = remote<&arange>(peer, std::int64_t{5000});
          EXPECT(at::equal(r.to_here().wait(30s), at::arange(5000, at::kLong)));
        }
        shutdown(true);
      },
      launch_options(std::chrono::seconds(120)));
}

TEST_CASE("a TLS worker refuses plain peers, untrusted and expired certificates, and keeps serving") {
  ThrowawayPki pki;
  ThrowawayPki rogue("rogue CA");
  const TlsOptions good = pki.issue("worker");
  const TlsOptions untrusted = [&] {
    TlsOptions o = rogue.issue("impostor");
    o.ca_file = pki.ca_file();  // it trusts the job's CA; the job does not trust its issuer
    return o;
  }();
  ThrowawayPki self_ca("self-signed");
  const TlsOptions self_signed = [&] {
    TlsOptions o = self_ca.self_signed();
    o.ca_file = pki.ca_file();
    return o;
  }();
  const TlsOptions expired = pki.issue("expired", /*expired=*/true);
  const TlsOptions trusts_rogue = [&] {
    TlsOptions o = pki.issue("client");
    o.ca_file = rogue.ca_file();  // presents a good certificate, but cannot verify the worker's
    return o;
  }();
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        asio::io_context io;
        const auto target = get_worker_info(1);
        const std::string secret = corpc::detail::secret_from_environment();
        auto dial = [&](const TlsOptions* tls) {
          corpc::detail::AuthConfig config{secret, std::chrono::seconds(5),
                                           tls ? corpc::detail::make_tls_context(*tls) : nullptr};
          return authenticated_transport(io, target, config);
        };
        // The control: the right certificate and secret pass.
        dial(&good);
        // A plain peer that knows the secret: the worker waits for a TLS handshake, the peer for a challenge.
        std::string why = EXPECT_THROWS_AS(dial(nullptr), ConnectionError);
        EXPECT(why.find("expect TLS") != std::string::npos);
        // A plain peer speaking frames at once (a worker without secret nor TLS): the handshake fails, dropped.
        {
          auto s = raw_socket(io, target);
          (void)write_raw_hello(s, get_worker_info(0), 2);
          EXPECT(hung_up(s));
        }
        // Certificates the job's CA did not sign, or that expired: the worker refuses them (TLS 1.3 tells the client
        // after its side of the handshake, so it learns it when it reads the challenge).
        why = EXPECT_THROWS_AS(dial(&untrusted), ConnectionError);
        EXPECT(why.find("unknown ca") != std::string::npos);
        why = EXPECT_THROWS_AS(dial(&self_signed), ConnectionError);
        EXPECT(why.find("unknown ca") != std::string::npos);
        why = EXPECT_THROWS_AS(dial(&expired), ConnectionError);
        EXPECT(why.find("expired") != std::string::npos);
        // The other way round: a dialer that does not trust the worker's CA refuses the worker.
        why = EXPECT_THROWS_AS(dial(&trusts_rogue), ConnectionError);
        EXPECT(why.find("certificate verify failed") != std::string::npos);
        // The worker still serves, and the job's own connections were never disturbed.
        const at::Tensor t = pattern(4096, 1);
        EXPECT(at::equal(rpc_sync<&echo_tensor>(1, t), t));
      },
      tls_options(good));
}

TEST_CASE("over TLS a stopped worker misses its deadlines, then is declared unreachable; the others go on") {
  ThrowawayPki pki;
  auto options = tls_options(pki.issue("worker"));
  options.liveness_timeout = 1s * time_scale();  // short for the test (the default is 15 s); stretched when sanitized
  options.rpc_timeout = 60s;  // longer than the test allows: only a deadline or the liveness check ends a call
  expect_stopped_worker2_declared_unreachable(options, [] {
    // A call with its own deadline ends at it, naming the worker, before the liveness check fails the rest.
    auto late = EXPECT_THROWS_AS(rpc_async<&add>(2, with_timeout(300ms), 1, 2).wait(20s), TimeoutError);
    EXPECT_CONTAINS(late, "worker2");
  });
}

TEST_CASE("ranks that disagree about TLS fail init_rpc with a typed error, never hang") {
  ThrowawayPki pki;
  const TlsOptions cert = pki.issue("rank");
  for (int tls_rank : {0, 1}) {
    INFO("the rank with TLS: " << tls_rank);
    launch_processes(
        2,
        [&](int rank) {
          auto options = quick_options();
          options.init_timeout = 2s;
          options.handshake_timeout = 300ms;
          if (rank == tls_rank) options.tls = cert;
          if (rank == 0) {
            // Nobody registers: rank 0 gives up at its init timeout.
            EXPECT_THROWS_AS(init_rpc(worker_name(rank), rank, 2, options), TimeoutError);
          } else {
            // Rank 1 learns it from the handshake with rank 0.
            const std::string why = EXPECT_THROWS_AS(init_rpc(worker_name(rank), rank, 2, options), ConnectionError);
            EXPECT(why.find("TLS") != std::string::npos);
          }
        },
        launch_options(std::chrono::seconds(60)));
  }
}

TEST_CASE("a lazily dialed peer whose certificate is not trusted fails the call with ConnectionError") {
  ThrowawayPki pki;
  ThrowawayPki other("other CA");
  // Rank 2's certificate comes from another CA that rank 0 trusts as well, rank 1 does not: rendezvous (through
  // rank 0) succeeds, rank 1's first call to rank 2 fails its handshake.
  const std::string both = pki.dir() + "/both.pem";
  {
    std::ofstream out(both);
    out << std::ifstream(pki.ca_file()).rdbuf() << std::ifstream(other.ca_file()).rdbuf();
  }
  std::vector<TlsOptions> certs{pki.issue("rank0"), pki.issue("rank1"), other.issue("rank2")};
  certs[0].ca_file = both;
  certs[2].ca_file = both;
  launch_processes(
      3,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, 3, tls_options(certs[rank]));
        if (rank == 1) {
          const std::string why = EXPECT_THROWS_AS(rpc_sync<&add>(2, 1, 1), ConnectionError);
          EXPECT_CONTAINS(why, "worker2");
          EXPECT_CONTAINS(why, "certificate verify failed");
          EXPECT_EQ(rpc_sync<&add>(0, 1, 1), 2);  // rank 0 is still reachable
        } else if (rank == 2) {
          EXPECT_EQ(rpc_sync<&add>(0, 2, 2), 4);
        }
        // Rank 1 counts rank 2 as lost, which a graceful shutdown would wait on: end after everyone is done instead
        // (rank 2 too must stay until rank 1 has dialed it, or rank 1 sees a refused connection, not the certificate).
        if (rank == 0) {
          while (reached(1) < 2) std::this_thread::sleep_for(10ms);  // the others have seen each other done
        } else {
          rpc_sync<&mark_reached>(0, 0);
          while (rpc_sync<&reached>(0, 0) < 2) std::this_thread::sleep_for(10ms);
          rpc_sync<&mark_reached>(0, 1);
        }
        shutdown(false);
      },
      launch_options(std::chrono::seconds(60)));
}

TEST_CASE("without certificate checks the secret still stops a relay that terminates TLS on both sides") {
  ThrowawayPki pki;
  TlsOptions unverified = pki.issue("rank");
  unverified.verify_peer = false;
  run_world(
      2,
      [&](int rank) {
        if (rank != 0) return;
        const auto worker = get_worker_info(1);
        const std::string secret = corpc::detail::secret_from_environment();
        const auto ctx = corpc::detail::make_tls_context(unverified);
        // The relay: TLS server to us, TLS client to worker1, passing the decrypted bytes on both ways.
        asio::io_context relay_io;
        asio::ip::tcp::acceptor acceptor(relay_io, {asio::ip::make_address("127.0.0.1"), 0});
        using corpc::detail::AuthRole;
        using corpc::detail::Transport;
        auto pump = [](Transport& from, Transport& to) -> asio::awaitable<void> {
          std::array<char, 4096> buf;
          for (;;) {
            const std::size_t n = co_await from.async_read_some(asio::buffer(buf), asio::use_awaitable);
            co_await asio::async_write(to, asio::buffer(buf.data(), n), asio::use_awaitable);
          }
        };
        asio::co_spawn(
            relay_io,
            [&]() -> asio::awaitable<void> {
              Transport us{co_await acceptor.async_accept(asio::use_awaitable)};
              Transport them{asio::ip::tcp::socket(relay_io)};
              co_await them.socket().async_connect({asio::ip::make_address(worker.host), worker.port},
                                                   asio::use_awaitable);
              co_await us.start_tls(*ctx, AuthRole::acceptor);
              co_await them.start_tls(*ctx, AuthRole::dialer);
              using namespace asio::experimental::awaitable_operators;
              co_await (pump(us, them) || pump(them, us));
            },
            asio::detached);
        std::thread relay_thread([&] { relay_io.run(); });
        struct StopOnExit {  // also when an EXPECT throws
          asio::io_context& io;
          std::thread& thread;
          ~StopOnExit() {
            io.stop();
            thread.join();
          }
        } stop_relay{relay_io, relay_thread};
        asio::io_context io;
        corpc::detail::AuthConfig config{secret, std::chrono::seconds(5), ctx};
        authenticated_transport(io, worker, config);  // the control: directly, the secret passes
        WorkerInfo via_relay = worker;
        via_relay.port = acceptor.local_endpoint().port();
        // Through it, the worker finds our proof made for another TLS session and hangs up.
        EXPECT_THROWS_AS(authenticated_transport(io, via_relay, config), ConnectionError);
        EXPECT_EQ(rpc_sync<&add>(1, 2, 3), 5);
      },
      tls_options(unverified));
}

TEST_CASE("over TLS the wire carries no plaintext (a relay between the ranks sees none)") {
  ThrowawayPki pki;
  const TlsOptions cert = pki.issue("rank");
  const at::Tensor payload = [] {
    at::Tensor t = at::empty({static_cast<std::int64_t>(sizeof kMarker)}, at::kByte);
    std::memcpy(t.data_ptr(), kMarker, sizeof kMarker);
    return t.repeat({64});
  }();
  for (bool tls : {false, true}) {
    INFO("tls: " << tls);
    const std::uint16_t port = free_port();
    asio::io_context io;
    asio::ip::tcp::acceptor relay_listener(io, {asio::ip::make_address("127.0.0.1"), 0});
    const std::uint16_t relay_port = relay_listener.local_endpoint().port();
    const std::string tap_file = pki.dir() + "/tap-" + std::to_string(tls);
    // Rank 1 reaches rank 0 through the relay: its calls to rank 0 (and their replies) travel on that connection.
    // The relay runs in a process of its own (the third one): a thread in this process would be inherited by none of
    // the forked ranks, which ThreadSanitizer refuses.
    launch_processes(
        3,
        [&](int rank) {
          if (rank == 2) {
            TappingRelay relay(port, TappingRelay::Listening{::dup(relay_listener.native_handle())});
            relay.wait_until_all_closed();
            std::ofstream(tap_file, std::ios::binary) << relay.seen();
            return;
          }
          auto options = tls ? tls_options(cert) : quick_options();
          options.init_method = "tcp://127.0.0.1:" + std::to_string(rank == 0 ? port : relay_port);
          init_rpc(worker_name(rank), rank, 2, options);
          if (rank == 1) {
            EXPECT_EQ(rpc_sync<&echo_string>(0, std::string(kMarker)), kMarker);
            EXPECT(at::equal(rpc_sync<&echo_tensor>(0, payload), payload));
          }
          shutdown(true);
        },
        launch_options(60s));
    std::ostringstream tapped;
    tapped << std::ifstream(tap_file, std::ios::binary).rdbuf();
    const std::string seen = tapped.str();
    CHECK(seen.size() > payload.nbytes());
    // Without TLS the marker is in plain sight (so the tap works); with TLS it is nowhere.
    CHECK((seen.find(kMarker) != std::string::npos) == !tls);
  }
}

}  // namespace test_tls
