// The receive budget (ReceiveBudget), in process: its byte and request totals, the wakes of paused readers, concurrent
// takers; and its per-connection share as a TCP connection applies it, over a real socket pair on 127.0.0.1 with the
// test playing the peer (no workers, no mocks).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../src/transport/connection.hpp"
#include "../src/transport/receive_budget.hpp"
#include "../src/transport/stream.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_receive_budget {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

TEST_CASE("ReceiveBudget: takes bytes and one request within both totals, refuses beyond either, taking nothing") {
  ReceiveBudget budget(1000, 3);
  CHECK(budget.bytes_limit() == 1000);
  CHECK(budget.bytes_used() == 0);
  CHECK(budget.try_take(400));
  CHECK(budget.try_take(600));  // exactly the total
  CHECK(budget.bytes_used() == 1000);
  CHECK_FALSE(budget.try_take(1));
  CHECK(budget.bytes_used() == 1000);
  budget.give_back(600);
  CHECK(budget.bytes_used() == 400);
  CHECK_FALSE(budget.try_take(601));
  CHECK(budget.bytes_used() == 400);
  CHECK(budget.try_take(600));
  budget.give_back(600);
  budget.give_back(400);
  CHECK(budget.bytes_used() == 0);

  // More than the whole budget, and amounts that would overflow a sum: refused, nothing taken.
  CHECK_FALSE(budget.try_take(1001));
  CHECK(budget.try_take(500));
  CHECK_FALSE(budget.try_take(~std::uint64_t{0}));
  CHECK_FALSE(budget.try_take(~std::uint64_t{0} - 100));
  CHECK(budget.bytes_used() == 500);
  budget.give_back(500);
}

TEST_CASE("ReceiveBudget: the count of requests held is a total of its own; a refusal by count gives the bytes back") {
  ReceiveBudget budget(1'000'000, 2);
  CHECK(budget.try_take(10));
  CHECK(budget.try_take(0));  // a request with no bytes still counts
  CHECK_FALSE(budget.try_take(10));
  CHECK(budget.bytes_used() == 10);  // the refused request's bytes were not kept
  budget.give_back(0);
  CHECK(budget.try_take(10));
  CHECK(budget.bytes_used() == 20);
  CHECK_FALSE(budget.try_take(1));
  budget.give_back(10);
  budget.give_back(10);
  CHECK(budget.bytes_used() == 0);
  CHECK(budget.try_take(1));
  CHECK(budget.try_take(1));
  CHECK_FALSE(budget.try_take(1));
}

TEST_CASE("ReceiveBudget: a paused reader's wake runs once, on the thread of the next give-back") {
  ReceiveBudget budget(100, 10);
  REQUIRE(budget.try_take(100));
  REQUIRE(budget.try_take(0));
  int first = 0, second = 0;
  std::thread::id woke_on;
  budget.on_next_give_back([&] {
    ++first;
    woke_on = std::this_thread::get_id();
  });
  budget.on_next_give_back([&] { ++second; });
  CHECK(first == 0);
  std::thread giver([&] { budget.give_back(100); });
  const auto giver_id = giver.get_id();
  giver.join();
  CHECK(first == 1);
  CHECK(second == 1);
  CHECK(woke_on == giver_id);
  budget.give_back(0);  // the wakes were used up
  CHECK(first == 1);
  CHECK(second == 1);
  // A reader that registers after a give-back finds that room when it re-checks; its wake waits for the next one.
  int third = 0;
  budget.on_next_give_back([&] { ++third; });
  CHECK(budget.try_take(100));
  CHECK(third == 0);
  budget.give_back(100);
  CHECK(third == 1);
  CHECK(first == 1);  // the earlier wakes are not run again
  CHECK(second == 1);
}

TEST_CASE("ReceiveBudget: concurrent takers never hold more than the totals together, and all of it comes back") {
  constexpr std::uint64_t kBytes = 10'000, kRequests = 8;
  ReceiveBudget budget(kBytes, kRequests);
  std::atomic<std::uint64_t> held_bytes{0}, held_requests{0};
  std::atomic<int> over{0}, granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::uniform_int_distribution<std::uint64_t> size(1, 3000);
      for (int i = 0; i < 20000; ++i) {
        const std::uint64_t n = size(rng);
        if (!budget.try_take(n)) continue;
        ++granted;
        if (held_bytes.fetch_add(n) + n > kBytes) ++over;
        if (held_requests.fetch_add(1) + 1 > kRequests) ++over;
        held_bytes.fetch_sub(n);
        held_requests.fetch_sub(1);
        budget.give_back(n);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(over.load() == 0);
  CHECK(granted.load() > 0);
  CHECK(budget.bytes_used() == 0);
  // Every request was given back too: the whole count can be taken again.
  for (std::uint64_t i = 0; i < kRequests; ++i) CHECK(budget.try_take(1));
  CHECK_FALSE(budget.try_take(1));
}

// The budget as TCP connections apply it: two connections over real sockets on 127.0.0.1, each allowed a share of a
// process-wide total; requests are written as raw frames by the test, which plays the peer and keeps each request's
// reservation (ReceiveCredit) for as long as it likes, as a pooled handler does.
namespace {

constexpr std::uint64_t kFrame = 1000;  // bytes a request reserves: its header and body

class BudgetedServer {
 public:
  struct Delivery {
    std::uint64_t id = 0;
    std::string body;
    std::uint32_t body_len = 0;
    bool refused = false;
  };

  BudgetedServer(std::uint64_t process_bytes, std::uint64_t per_connection)
      : budget_(process_bytes, 1000), acceptor_(io_, {asio::ip::make_address("127.0.0.1"), 0}) {
    settings_.budget = &budget_;
    settings_.budget_per_connection = per_connection;
  }
  ~BudgetedServer() { stop(); }

  ReceiveBudget& budget() { return budget_; }

  // A new connection: its client end (the test writes to it) and its index here.
  int connect() {
    clients_.emplace_back(client_io_);
    clients_.back().connect(acceptor_.local_endpoint());
    asio::ip::tcp::socket accepted(io_);
    acceptor_.accept(accepted);
    const int index = static_cast<int>(conns_.size());
    {
      std::lock_guard lock(mutex_);
      delivered_.emplace_back();
      credits_.emplace_back();
    }
    conns_.push_back(make_tcp_connection(
        Transport(std::move(accepted)), settings_,
        [this, index](const std::shared_ptr<Connection>& conn, Message&& msg) {
          Delivery d{msg.head.id, msg.body, msg.head.body_len, conn->delivering_refused()};
          ReceiveCredit credit = conn->take_receive_credit();
          std::lock_guard lock(mutex_);
          delivered_[static_cast<std::size_t>(index)].push_back(std::move(d));
          credits_[static_cast<std::size_t>(index)].push_back(std::move(credit));
          cv_.notify_all();
        },
        [this](const std::shared_ptr<Connection>&, const std::string&) {
          std::lock_guard lock(mutex_);
          ++closed_;
          cv_.notify_all();
        }));
    return index;
  }

  void start() {
    io_thread_ = std::thread([this] { io_.run(); });
  }

  // Writes a request of `bytes` in all (header and body) on connection `index`, its body filled with `fill`.
  void send_request(int index, std::uint64_t id, std::uint64_t bytes, char fill) {
    FrameHeader h;
    h.kind = FrameKind::Request;
    h.id = id;
    h.body_len = static_cast<std::uint32_t>(bytes - sizeof(FrameHeader));
    std::string wire(reinterpret_cast<const char*>(&h), sizeof h);
    wire.append(h.body_len, fill);
    asio::write(clients_[static_cast<std::size_t>(index)], asio::buffer(wire));
  }

  // Waits (bounded, for a failure to show rather than hang) until connection `index` has delivered `n` requests.
  bool wait_delivered(int index, std::size_t n) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, 30s, [&] { return delivered_[static_cast<std::size_t>(index)].size() >= n; });
  }
  std::vector<Delivery> delivered(int index) {
    std::lock_guard lock(mutex_);
    return delivered_[static_cast<std::size_t>(index)];
  }
  // Gives back the reservation of the `k`th request delivered on `index` (the handler has answered it).
  void answer(int index, std::size_t k) {
    ReceiveCredit credit;
    {
      std::lock_guard lock(mutex_);
      credit = std::move(credits_[static_cast<std::size_t>(index)].at(k));
    }
    credit.release();
  }

  void stop() {
    if (!io_thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      for (auto& cs : credits_)
        for (auto& c : cs) c.release();
    }
    for (auto& c : conns_) c->close("test over");
    {
      std::unique_lock lock(mutex_);
      cv_.wait_for(lock, 30s, [&] { return closed_ == static_cast<int>(conns_.size()); });
    }
    io_.stop();
    io_thread_.join();
  }

 private:
  ReceiveBudget budget_;
  ConnectionSettings settings_;
  asio::io_context io_, client_io_;
  asio::ip::tcp::acceptor acceptor_;
  std::vector<asio::ip::tcp::socket> clients_;
  std::vector<std::shared_ptr<Connection>> conns_;
  std::thread io_thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::vector<Delivery>> delivered_;
  std::vector<std::vector<ReceiveCredit>> credits_;
  int closed_ = 0;
};

}  // namespace

TEST_CASE(
    "ReceiveBudget on TCP connections: a connection's share and the process total each pause reading; "
    "a give-back resumes it; a request over the share is refused without a reservation") {
  // Room for three requests in the process, two per connection.
  BudgetedServer server(3 * kFrame, 2 * kFrame);
  const int a = server.connect(), b = server.connect();
  server.start();

  // Connection a: three requests; the third waits for the connection's share although the process has room.
  for (std::uint64_t id = 1; id <= 3; ++id) server.send_request(a, id, kFrame, 'a');
  REQUIRE(server.wait_delivered(a, 2));
  std::this_thread::sleep_for(200ms);
  CHECK(server.delivered(a).size() == 2);
  CHECK(server.budget().bytes_used() == 2 * kFrame);
  server.answer(a, 0);
  REQUIRE(server.wait_delivered(a, 3));
  CHECK(server.delivered(a)[2].id == 3);
  CHECK(server.delivered(a)[2].body == std::string(kFrame - sizeof(FrameHeader), 'a'));
  CHECK(server.budget().bytes_used() == 2 * kFrame);

  // Connection b: its own share is free, the process total has room for one: the second request waits for it.
  server.send_request(b, 11, kFrame, 'b');
  server.send_request(b, 12, kFrame, 'b');
  REQUIRE(server.wait_delivered(b, 1));
  std::this_thread::sleep_for(200ms);
  CHECK(server.delivered(b).size() == 1);
  CHECK(server.budget().bytes_used() == 3 * kFrame);
  server.answer(a, 1);  // a request on the other connection is answered: b resumes
  REQUIRE(server.wait_delivered(b, 2));
  CHECK(server.delivered(b)[1].id == 12);
  CHECK(server.budget().bytes_used() == 3 * kFrame);

  // b now holds one request, a one more: the process total is spent while b's share has room.
  server.answer(b, 0);
  server.send_request(a, 4, kFrame, 'a');
  REQUIRE(server.wait_delivered(a, 4));
  CHECK(server.budget().bytes_used() == 3 * kFrame);

  // Over the connection's share: dropped at once (the budget being spent or not), delivered as refused with its
  // header only and no reservation; the request after it on the same stream is read intact once there is room.
  server.send_request(b, 13, 2 * kFrame + 1, 'x');
  server.send_request(b, 14, kFrame, 'c');
  REQUIRE(server.wait_delivered(b, 3));
  {
    const auto refused = server.delivered(b)[2];
    CHECK(refused.id == 13);
    CHECK(refused.refused);
    CHECK(refused.body.empty());
    CHECK(refused.body_len == 2 * kFrame + 1 - sizeof(FrameHeader));
  }
  CHECK(server.budget().bytes_used() == 3 * kFrame);
  std::this_thread::sleep_for(200ms);
  CHECK(server.delivered(b).size() == 3);  // 14 waits for the process total
  server.answer(a, 2);
  REQUIRE(server.wait_delivered(b, 4));
  {
    const auto after = server.delivered(b)[3];
    CHECK(after.id == 14);
    CHECK_FALSE(after.refused);
    CHECK(after.body == std::string(kFrame - sizeof(FrameHeader), 'c'));
  }
  CHECK(server.budget().bytes_used() == 3 * kFrame);
  server.answer(b, 2);  // the refused request's (empty) reservation gives back nothing
  CHECK(server.budget().bytes_used() == 3 * kFrame);
  server.answer(a, 3);
  server.answer(b, 1);
  server.answer(b, 3);
  CHECK(server.budget().bytes_used() == 0);
  server.stop();
}

}  // namespace test_receive_budget
