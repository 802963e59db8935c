// A dead rank's address is not the rank: whoever listens there after it died (a process holding the job's secret, or a
// relay without it that passes the handshake on to the real replacement) must get no request answered as that rank,
// no reply accepted, and no Hello of ours to replay elsewhere; and a peer that never met the rank's replacement must
// reach it, not the address of its dead predecessor.
#include <asio.hpp>
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../src/rpc/hello.hpp"
#include "../src/rpc/runtime_impl.hpp"
#include "../src/transport/connection.hpp"
#include "raw_peer.hpp"
#include "support.hpp"

// g++ at -O1 inlines Asio's coroutine frames' class-specific operator delete and reports it as mismatched with the
// same class's operator new (as in src/transport/auth.cpp): a false positive, for the coroutines of this file.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

namespace test_impostors {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace cd = corpc::detail;

namespace {

int add(int a, int b) { return a + b; }
bool is_alive_here(int rank) { return Runtime::get().is_alive(rank); }
std::string whoami() { return get_worker_info().name; }
std::string whoami_via(int rank) { return rpc_sync<&whoami>(rank); }
// Where this worker takes connections: its TCP port and the name of its abstract Unix socket.
std::string listening_at() {
  return std::to_string(get_worker_info().port) + " " + rpc_socket_of(static_cast<int>(::getpid()));
}

// Files through which the ranks of one launch (children of one launcher) pass words outside corpc.
std::string flag(const std::string& what) { return "/tmp/corpc-impostors-" + std::to_string(::getppid()) + "-" + what; }
void raise_flag(const std::string& what, const std::string& words = "up") { std::ofstream(flag(what)) << words; }
std::string wait_for_flag(const std::string& what) {
  for (;;) {
    std::ifstream in(flag(what));
    std::string words;
    if (std::getline(in, words) && !words.empty()) return words;
    std::this_thread::sleep_for(10ms);
  }
}

std::string frame_bytes(const cd::FrameHeader& h, const std::string& body) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof h) + body;
}

// A process that holds the job's secret and listens where a dead rank listened: on its TCP port and its abstract Unix
// socket. It answers every dialer's Hello as that rank (with a key of its own and a signature of nothing) and every
// request with a forged reply; it keeps the first Hello it is sent, and counts the requests it is sent.
class Squatter {
 public:
  Squatter(int rank, std::uint16_t port, const std::string& unix_name, std::string public_key)
      : rank_(rank), tcp_(io_), unix_(io_), secret_(cd::secret_from_environment()), public_key_(std::move(public_key)) {
    // The port, if it is still free: once the rank is gone, any socket on the host may be given it as its own
    // ephemeral port. The Unix socket is what a peer on this host dials first, and its name is ours to take.
    asio::error_code busy;
    tcp_.open(asio::ip::tcp::v4());
    tcp_.set_option(asio::ip::tcp::acceptor::reuse_address(true));
    tcp_.bind({asio::ip::make_address("127.0.0.1"), port}, busy);
    if (!busy) tcp_.listen(asio::socket_base::max_listen_connections, busy);
    squatting_tcp_ = !busy;
    if (!unix_name.empty()) {
      unix_.open();
      // The dead rank's descriptors close one by one as its process ends: its connection to rank 0 (how we learnt of
      // the death) may close before its listener does. A squatter waits for the name to be free.
      const asio::local::stream_protocol::endpoint name(std::string(1, '\0') + unix_name);
      const auto give_up = std::chrono::steady_clock::now() + 10s;
      asio::error_code taken;
      while (unix_.bind(name, taken), taken && std::chrono::steady_clock::now() < give_up)
        std::this_thread::sleep_for(5ms);
      if (taken) throw std::runtime_error("squatting Unix socket " + unix_name + ": " + taken.message());
      unix_.listen();
      accept_unix();
    }
    if (squatting_tcp_) accept_tcp();
    thread_ = std::thread([this] { io_.run(); });
  }
  ~Squatter() {
    asio::post(io_, [this] {
      asio::error_code ignored;
      tcp_.close(ignored);
      unix_.close(ignored);
      io_.stop();
    });
    thread_.join();
  }
  int requests() const { return requests_.load(); }
  int hellos() const { return hellos_.load(); }
  std::string first_hello() const {
    std::lock_guard lock(mutex_);
    return first_hello_;
  }

 private:
  void accept_tcp() {
    tcp_.async_accept([this](const asio::error_code& ec, asio::ip::tcp::socket s) {
      if (ec) return;
      serve(std::move(s));
      accept_tcp();
    });
  }
  void accept_unix() {
    unix_.async_accept([this](const asio::error_code& ec, asio::local::stream_protocol::socket s) {
      if (ec) return;
      asio::ip::tcp::socket adopted(io_);
      adopted.assign(asio::ip::tcp::v4(), s.release());
      serve(std::move(adopted));
      accept_unix();
    });
  }
  void serve(asio::ip::tcp::socket s) { asio::co_spawn(io_, session(cd::Transport(std::move(s))), asio::detached); }
  asio::awaitable<void> session(cd::Transport t) {
    try {
      const cd::AuthConfig config{secret_, 10s, nullptr};
      co_await cd::authenticate(t, config, cd::AuthRole::acceptor);
      const bool sealed = !t.session_keys().send_key.empty();
      std::unique_ptr<cd::FrameSeal> seal;
      if (sealed) seal = std::make_unique<cd::FrameSeal>(t.session_keys().send_key);
      // The frame with its tag. (No temporaries in the co_await expressions below: g++ 12 destroys some twice.)
      auto with_tag = [&](std::string frame) {
        if (seal) {
          seal->begin();
          seal->add(frame.data(), frame.size());
          const auto tag = seal->tag();
          frame.append(reinterpret_cast<const char*>(tag.data()), tag.size());
        }
        return frame;
      };
      std::string out;
      for (;;) {
        cd::FrameHeader h;
        auto header = asio::buffer(&h, sizeof h);
        co_await asio::async_read(t, header, asio::use_awaitable);
        std::string rest(std::size_t{h.meta_len} + h.body_len + ((h.flags & cd::kFlagShm) ? 0 : h.tensor_bytes) +
                             (sealed ? cd::FrameSeal::kTagBytes : 0),
                         '\0');
        auto payload = asio::buffer(rest);
        co_await asio::async_read(t, payload, asio::use_awaitable);
        if (h.kind == cd::FrameKind::Hello) {
          ++hellos_;
          {
            std::lock_guard lock(mutex_);
            if (first_hello_.empty()) first_hello_ = frame_bytes(h, rest.substr(h.meta_len, h.body_len));
          }
          cd::Hello answer;
          answer.self.name = worker_name(rank_);
          answer.self.rank = rank_;
          answer.world_size = 3;
          answer.public_key = public_key_;
          answer.proof = std::string(64, '\0');
          cd::Message m;
          m.head.kind = cd::FrameKind::Hello;
          m.body = cd::encode_hello(answer);
          cd::OutFrame f = cd::prepare(std::move(m));
          out = with_tag(frame_bytes(f.head, f.body));
          co_await asio::async_write(t, asio::buffer(out), asio::use_awaitable);
        } else if (h.kind == cd::FrameKind::Request) {
          ++requests_;
          cd::Message forged = cd::encode_reply(-1, 0);
          cd::FrameHeader r;
          r.kind = cd::FrameKind::Response;
          r.id = h.id;
          r.body_len = static_cast<std::uint32_t>(forged.body.size());
          out = with_tag(frame_bytes(r, forged.body));
          co_await asio::async_write(t, asio::buffer(out), asio::use_awaitable);
        }
      }
    } catch (const std::exception&) {
      // The dialer hung up (or refused us): that is what is expected of it.
    }
  }

  const int rank_;
  asio::io_context io_;
  asio::ip::tcp::acceptor tcp_;
  asio::local::stream_protocol::acceptor unix_;
  const std::string secret_;
  const std::string public_key_;
  bool squatting_tcp_ = false;
  std::atomic<int> requests_{0}, hellos_{0};
  mutable std::mutex mutex_;
  std::string first_hello_;
  std::thread thread_;
};

}  // namespace

TEST_CASE(
    "a process with the secret at a dead rank's address answers nothing as that rank; the replacement is reached") {
  // worker1 is SIGKILLed before worker2 ever dialled it; a process holding the secret (here a thread of worker2's)
  // takes its TCP port and Unix socket. worker2's calls to worker1 used to go to it and take its forged replies, and
  // the signed Hello worker2 sent it could be replayed to worker1's replacement, which took it as worker2's. Now the
  // squatter's answer is refused before any request is sent, and worker2's call fails saying so; the Hello it was sent
  // proves nothing on another connection; and once the launcher's replacement has registered, rank 0's word brings
  // worker2 to it, although it never dialled worker2.
  const std::vector<std::string> flags{"old", "squatted", "new"};
  for (const auto& what : flags) ::unlink(flag(what).c_str());
  LaunchOptions restart_once = launch_options(120s);
  restart_once.max_rank_restarts = 1;
  launch_processes(
      3,
      [](int rank) {
        if (rank == 1 && rank_restart_count() > 0) (void)wait_for_flag("squatted");  // the squatter goes first
        init_rpc(worker_name(rank), rank, 3, quick_options());
        if (rank == 1 && rank_restart_count() == 0) {
          raise_flag("old", listening_at());
          ::raise(SIGKILL);
        }
        if (rank == 1) raise_flag("new", listening_at());
        if (rank == 2) {
          std::istringstream old(wait_for_flag("old"));
          int port = 0;
          std::string unix_name;
          old >> port >> unix_name;
          while (rpc_sync<&is_alive_here>(0, 1)) std::this_thread::sleep_for(10ms);  // rank 0 saw it die
          std::string replayed;
          {
            // It even shows worker1's real public key (the world table's); it cannot sign with it.
            Squatter squatter(1, static_cast<std::uint16_t>(port), unix_name,
                              runtime_impl(Runtime::get()).rendezvous->proofs().identities().get(1).public_key);
            std::string error;
            try {
              const int forged = rpc_async<&add>(1, with_timeout(30s), 20, 22).wait(60s);
              FAIL("a reply from the squatter was accepted: " << forged);
            } catch (const ConnectionError& e) {
              error = e.what();
            }
            INFO(error);
            CHECK(error.find("answered as worker 'worker1' (rank 1)") != std::string::npos);
            CHECK(error.find("cannot prove it is rank 1") != std::string::npos);
            CHECK(squatter.hellos() >= 1);
            CHECK_EQ(squatter.requests(), 0);  // nothing of ours but the Hello reached it
            replayed = squatter.first_hello();
            CHECK(Runtime::get().is_alive(1));  // an impostor says nothing of the rank itself
          }
          REQUIRE(!replayed.empty());
          raise_flag("squatted");
          // The Hello we sent the squatter, replayed by a process with the secret to worker1's replacement (to which
          // it is addressed, rank 1) before we dialled it: refused, and the connection closed.
          std::istringstream now(wait_for_flag("new"));
          int new_port = 0;
          now >> new_port;
          {
            asio::io_context io;
            auto s = authenticated_socket(
                io, WorkerInfo{worker_name(1), 1, "127.0.0.1", static_cast<std::uint16_t>(new_port)});
            asio::write(s, asio::buffer(sealed(s, replayed)));
            CHECK(hung_up_within(io, s));
          }
          // Rank 0's word brings us to the replacement, which never dialled us.
          const auto deadline = std::chrono::steady_clock::now() + 60s;
          std::optional<int> sum;
          while (!sum && std::chrono::steady_clock::now() < deadline) {
            try {
              sum = rpc_async<&add>(1, with_timeout(10s), 20, 22).wait(20s);
            } catch (const RpcError&) {
              std::this_thread::sleep_for(20ms);
            }
          }
          CHECK_EQ(sum.value_or(0), 42);
          CHECK(rpc_sync<&is_alive_here>(1, 2));                  // the replay did not take our place there ...
          CHECK_EQ(rpc_sync<&whoami_via>(1, 2), worker_name(2));  // ... and the replacement reaches us
        }
        shutdown(true);
      },
      restart_once);
  for (const auto& what : flags) ::unlink(flag(what).c_str());
}

namespace {

// What one connection through a relay delivered: the bodies of the frames that reached the dialer, and why it closed.
struct Delivered {
  std::vector<std::string> bodies;
  std::string closed;
};

// A dialer and an acceptor with `secret` (empty: none), the dialer dialling a relay that passes every byte on both ways
// but writes "forged!" over each "genuine" it carries from the acceptor to the dialer. The acceptor answers the
// dialer's one frame with a frame whose body is "genuine".
Delivered through_rewriting_relay(const std::string& secret) {
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  const cd::AuthConfig auth{secret, 10s, nullptr};
  cd::ConnectionSettings settings;
  std::shared_ptr<cd::Connection> served;
  asio::ip::tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  acceptor.async_accept([&](const asio::error_code& ec, asio::ip::tcp::socket s) {
    if (ec) return;
    asio::co_spawn(
        io,
        [&, s = std::move(s)]() mutable -> asio::awaitable<void> {
          cd::Transport t(std::move(s));
          co_await cd::authenticate(t, auth, cd::AuthRole::acceptor);
          served = cd::make_tcp_connection(
              std::move(t), settings,
              [](const std::shared_ptr<cd::Connection>& c, cd::Message&&) {
                cd::Message reply;
                reply.head.kind = cd::FrameKind::Response;
                reply.head.id = 1;
                reply.body = "genuine";
                c->send(cd::prepare(std::move(reply)));
              },
              [](const std::shared_ptr<cd::Connection>&, const std::string&) {}, "127.0.0.1");
        },
        asio::detached);
  });
  // The relay: one connection each way, bytes passed on as they come.
  asio::ip::tcp::acceptor relay(io, {asio::ip::make_address("127.0.0.1"), 0});
  auto from_dialer = std::make_shared<asio::ip::tcp::socket>(io);
  auto to_acceptor = std::make_shared<asio::ip::tcp::socket>(io);
  auto pump = [](std::shared_ptr<asio::ip::tcp::socket> in, std::shared_ptr<asio::ip::tcp::socket> out,
                 bool rewrite) -> asio::awaitable<void> {
    std::string carried;
    char buf[4096];
    try {
      for (;;) {
        const std::size_t n = co_await in->async_read_some(asio::buffer(buf), asio::use_awaitable);
        std::string chunk(buf, n);
        if (rewrite)
          for (std::size_t at; (at = chunk.find("genuine")) != std::string::npos;) chunk.replace(at, 7, "forged!");
        co_await asio::async_write(*out, asio::buffer(chunk), asio::use_awaitable);
      }
    } catch (const std::exception&) {
      asio::error_code ignored;
      out->shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
    }
  };
  relay.async_accept(*from_dialer, [&](const asio::error_code& ec) {
    if (ec) return;
    to_acceptor->async_connect(acceptor.local_endpoint(), [&](const asio::error_code& ec2) {
      if (ec2) return;
      asio::co_spawn(io, pump(from_dialer, to_acceptor, false), asio::detached);
      asio::co_spawn(io, pump(to_acceptor, from_dialer, true), asio::detached);
    });
  });
  Delivered delivered;
  bool done = false;
  auto dialer = cd::dial_tcp_connection(
      io, 1, "127.0.0.1", relay.local_endpoint().port(), "", settings,
      [&](const std::shared_ptr<cd::Connection>& c, cd::Message&& m) {
        delivered.bodies.push_back(m.body);
        done = true;
        c->close("done");
      },
      [&](const std::shared_ptr<cd::Connection>&, const std::string& why) {
        if (delivered.closed.empty()) delivered.closed = why;
        done = true;
      },
      auth);
  cd::Message request;
  request.head.kind = cd::FrameKind::Request;
  request.head.id = 1;
  request.body = "ask";
  dialer->send(cd::prepare(std::move(request)));
  asio::steady_timer limit(io, 30s);
  limit.async_wait([&](const asio::error_code& ec) {
    if (!ec) done = true;
  });
  while (!done && io.run_one()) {}
  dialer->close("test over");
  if (served) served->close("test over");
  acceptor.close();
  relay.close();
  limit.cancel();
  work.reset();
  io.run_for(1s);
  return delivered;
}

}  // namespace

TEST_CASE("a relay on the path cannot change a frame: with the secret every frame is sealed for its connection") {
  // The relay holds no secret: it passes the handshake on untouched (it cannot answer it), then rewrites what it
  // carries. Without a secret (the control) its forgery is what the dialer gets; with one the forged frame fails its
  // tag and the connection ends before anything of it is delivered.
  const Delivered open = through_rewriting_relay("");
  REQUIRE_EQ(open.bodies.size(), 1u);
  CHECK_EQ(open.bodies[0], "forged!");
  const Delivered sealed_run = through_rewriting_relay("a secret of this test");
  CHECK(sealed_run.bodies.empty());
  INFO(sealed_run.closed);
  CHECK(sealed_run.closed.find("integrity check") != std::string::npos);
}

TEST_CASE("the same-host channel is taken only with its connection's claim, not with the cookie a relay can read") {
  // The acceptor's answer, which carries the cookie, is tagged, not encrypted: a process on the path can read it. With
  // the cookie alone it used to claim the channel before the dialer, reading the acceptor's tensors from its own
  // segment. The claim is the cookie's HMAC under the secret over the connection's transcript: only the two ends can
  // make it, and it is good for that connection alone.
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::thread runner([&] { io.run(); });
  std::atomic<int> attached{0};
  {
    cd::ShmListener listener(io, "test");
    const std::string secret = "a secret of this test", transcript = "the nonces of one connection";
    const std::string cookie =
        listener.offer([&](std::shared_ptr<cd::ShmChannel>) { ++attached; }, [] { return true; },
                       [&](const std::string& c) { return cd::channel_claim(secret, transcript, c); });
    auto present = [&](const std::string& claim) {
      std::promise<std::string> failure;
      auto dial = cd::dial_shm_channel(
          listener.name(), claim, 1 << 20, [](std::shared_ptr<cd::ShmChannel>) {}, 10s);
      asio::co_spawn(io, std::move(dial),
                     [&](std::exception_ptr e, std::string why) { failure.set_value(e ? "it threw" : why); });
      return failure.get_future().get();
    };
    CHECK_FALSE(present(cookie).empty());  // what a relay read in the answer
    CHECK_FALSE(present(cd::channel_claim("another secret", transcript, cookie)).empty());
    CHECK_FALSE(present(cd::channel_claim(secret, "another connection's nonces", cookie)).empty());
    CHECK_EQ(attached.load(), 0);
    CHECK_EQ(present(cd::channel_claim(secret, transcript, cookie)), "");  // the dialer's own
    CHECK_EQ(attached.load(), 1);
    CHECK_EQ(cd::channel_claim("", transcript, cookie), cookie);  // without a secret there is nothing to bind it to
    listener.close();
  }
  work.reset();
  runner.join();
}

}  // namespace test_impostors
