// A connection's call engine (src/rpc/call_engine.hpp) on its own, without sockets or workers: a connection that
// records what is sent plays the wire, a host of the test's plays the runtime, and the test plays the callee by
// handing replies to on_reply. What is checked is what a caller sees (its future's value or typed error) and what the
// callee would see (the frames: a request, then a cancel frame when the caller gives up), and that the counts
// graceful shutdown waits on come back to zero whatever the outcome.
#include <doctest/doctest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "corpc/rpc/detail/call.hpp"

#include "../src/rpc/call_engine.hpp"
#include "../src/rpc/error_frames.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_call_engine {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {

int add_ints(int a, int b) { return a + b; }

// The runtime as an engine sees it: names, plain framing, counts for two workers, a cancel that reaches the engine.
class TestHost final : public CallHost {
 public:
  std::string name_of(int rank) const override { return "worker" + std::to_string(rank); }
  OutFrame frame_for(Message&& m, int, Connection&) override { return prepare(std::move(m)); }
  void received_tensors(const FrameHeader&, int, std::vector<at::Tensor>&) override {}
  void arm_cancel(CancelSlot& slot, Connection& conn, std::uint64_t id) override {
    CancelHook hook;
    hook.fn = [](const CancelHook& h) noexcept {
      auto conn = static_cast<Connection*>(h.p)->shared_from_this();
      CallEngine::of(*conn).cancel(conn, h.b);
    };
    hook.p = &conn;
    hook.b = id;
    slot.arm_cancel(std::move(hook));
  }
  Activity& activity() override { return activity_; }
  std::chrono::milliseconds default_timeout() const override { return timeout; }

  std::chrono::milliseconds timeout = 60s;

 private:
  Activity activity_{2};
};

// A connection to worker 1 that we dialed, with an engine allowing `max_in_flight` unanswered calls.
struct Wire {
  asio::io_context io;
  TestHost host;
  std::shared_ptr<corpc::test::TableConnection> conn;
  explicit Wire(std::size_t max_in_flight = 64, bool dialed = true) {
    conn = std::make_shared<corpc::test::TableConnection>(io, "10.0.0.1:1",
                                                          CallEngine::factory(host, max_in_flight, dialed));
    conn->peer_rank = 1;
  }
  CallEngine& engine() { return CallEngine::of(*conn); }

  // Calls add_ints(a, b) on worker 1, as rpc_async does, and returns its future.
  Future<int> call(int a, int b, std::optional<std::chrono::milliseconds> timeout = std::nullopt,
                   bool send_now = false) {
    auto* state = FutureState<int>::make();
    Future<int> fut = future_of(state);
    OutboundCall c;
    c.dst = 1;
    c.function = function_name<&add_ints>();
    c.function_is_static = true;
    c.function_id = function_id(function_name<&add_ints>());
    c.signature = signature_of<std::tuple<int, int>>();
    c.timeout = timeout;
    c.send_now = send_now;
    encode_args<std::tuple<int, int>>(c.message, 1, a, b);
    c.complete = &complete_call<int>;
    c.target = state;
    c.cancel = state;
    try {
      engine().start(conn, std::move(c));
    } catch (...) {
      state->set_exception(std::current_exception());
      state->release();
    }
    return fut;
  }

  // The callee's answer to request `id`: `value`, or `error` thrown by the function.
  void reply(std::uint64_t id, int value) {
    Message m = encode_reply(value, 0);
    m.head.kind = FrameKind::Response;
    m.head.id = id;
    engine().on_reply(conn, std::move(m));
  }
  void reply_error(std::uint64_t id, std::exception_ptr error) {
    Message m = error_frame(id, std::move(error), "worker1", "add_ints");
    engine().on_reply(conn, std::move(m));
  }
  // Runs the connection's I/O thread's work (the deadline timer) until `done` or 5 s, whichever is first.
  template <class F>
  void run_until(F done) {
    for (int i = 0; i < 500 && !done(); ++i) {
      io.restart();
      io.run_for(10ms);
    }
  }
  std::uint64_t in_flight() { return host.activity().calls_in_flight(); }
};

// Stands for the executor of a coroutine or an I/O thread: a call made under it never blocks for room (it waits in
// the engine instead). Nothing is queued on it here.
struct ElsewhereExecutor final : Executor {
  void enqueue(WorkItem* item) noexcept override { item->run(item); }
};

bool is_cancel_for(const OutFrame& f, std::uint64_t id) {
  return f.head.kind == FrameKind::Request && (f.head.flags & kFlagCancel) && f.head.id == id;
}

}  // namespace

TEST_CASE("CallEngine: a call leaves as one request frame and its reply completes the caller's future") {
  Wire w;
  auto fut = w.call(2, 3, std::nullopt, /*send_now=*/true);
  REQUIRE(w.conn->sent.size() == 1);
  const OutFrame& f = w.conn->sent[0];
  CHECK(f.head.kind == FrameKind::Request);
  CHECK(f.head.function == function_id(function_name<&add_ints>()));
  CHECK(f.head.deadline_ms == 60000);
  CHECK(f.send_now);
  CHECK(w.in_flight() == 1);
  CHECK(w.host.activity().sent_counts()[1] == 1);
  CHECK_FALSE(fut.done());
  w.reply(f.head.id, 5);
  REQUIRE(fut.done());
  CHECK(std::move(fut).value() == 5);
  CHECK(w.in_flight() == 0);
}

TEST_CASE("CallEngine: an error frame becomes the callee's typed error; a late or foreign reply is told apart") {
  Wire w;
  auto fut = w.call(1, 1);
  const std::uint64_t id = w.conn->sent.at(0).head.id;
  w.reply_error(id, std::make_exception_ptr(std::runtime_error("boom")));
  REQUIRE(fut.done());
  EXPECT_CONTAINS(EXPECT_THROWS_AS(std::move(fut).value(), RemoteError), "boom");
  CHECK(w.in_flight() == 0);
  w.reply(id, 7);  // late: its call is complete already; nothing happens
  CHECK_FALSE(w.conn->closed);
  w.reply(id + 1000, 7);  // an id this connection never issued: the peer is broken
  CHECK(w.conn->closed);
  EXPECT_CONTAINS(w.conn->closed_why, "never sent");
}

TEST_CASE("CallEngine: cancelling the future completes it with CancelledError and tells the callee") {
  Wire w;
  auto fut = w.call(1, 2);
  const std::uint64_t id = w.conn->sent.at(0).head.id;
  fut.cancel();
  REQUIRE(fut.done());
  EXPECT_THROWS_AS(std::move(fut).value(), CancelledError);
  REQUIRE(w.conn->sent.size() == 2);
  CHECK(is_cancel_for(w.conn->sent[1], id));
  CHECK(w.in_flight() == 0);
  w.reply(id, 3);  // the callee answered anyway: late, ignored
  CHECK_FALSE(w.conn->closed);
}

TEST_CASE("CallEngine: past its deadline a call fails with TimeoutError naming it, and the callee is told to stop") {
  Wire w;
  auto fut = w.call(1, 2, 30ms);
  const std::uint64_t id = w.conn->sent.at(0).head.id;
  auto other = w.call(3, 4);  // the default timeout: still pending after the first has timed out
  w.run_until([&] { return fut.done(); });
  REQUIRE(fut.done());
  const std::string what = EXPECT_THROWS_AS(std::move(fut).value(), TimeoutError);
  EXPECT_CONTAINS(what, "add_ints");
  EXPECT_CONTAINS(what, "worker1");
  CHECK(is_cancel_for(w.conn->sent.back(), id));
  CHECK_FALSE(other.done());
  CHECK(w.in_flight() == 1);
  w.reply(w.conn->sent.at(1).head.id, 7);
  CHECK(std::move(other).value() == 7);
}

TEST_CASE("CallEngine: beyond the per-peer limit a call waits unsent, and leaves when a reply frees room") {
  Wire w(1);
  auto first = w.call(1, 1);
  ElsewhereExecutor elsewhere;
  Future<int> second;
  {
    ExecutorScope scope(&elsewhere);  // a caller on an executor is not blocked: its call waits unsent
    second = w.call(2, 2);
  }
  CHECK_FALSE(second.done());
  REQUIRE(w.conn->sent.size() == 1);
  CHECK(w.host.activity().sent_counts()[1] == 1);
  w.reply(w.conn->sent[0].head.id, 2);
  CHECK(std::move(first).value() == 2);
  REQUIRE(w.conn->sent.size() == 2);  // the reply made room: the waiting call left
  CHECK(w.host.activity().sent_counts()[1] == 2);
  w.reply(w.conn->sent[1].head.id, 4);
  CHECK(std::move(second).value() == 4);
  CHECK(w.in_flight() == 0);
}

TEST_CASE("CallEngine: a closed connection fails every pending call with its error and refuses later ones") {
  Wire w;
  auto a = w.call(1, 1);
  auto b = w.call(2, 2);
  w.engine().closed(std::make_exception_ptr(ConnectionError("worker1 is gone: test")));
  REQUIRE(a.done());
  REQUIRE(b.done());
  EXPECT_CONTAINS(EXPECT_THROWS_AS(std::move(a).value(), ConnectionError), "test");
  EXPECT_THROWS_AS(std::move(b).value(), ConnectionError);
  CHECK(w.in_flight() == 0);
  auto later = w.call(3, 3);
  REQUIRE(later.done());
  EXPECT_CONTAINS(EXPECT_THROWS_AS(std::move(later).value(), ConnectionError), "gone");
  CHECK(w.in_flight() == 0);
}

TEST_CASE("CallEngine: a call over the peer's limits throws before it is registered or counted") {
  Wire w;
  WireLimits small;
  small.max_body_bytes = 4;
  w.conn->peer_limits = small;
  auto fut = w.call(1, 2);  // two ints: 8 bytes of body
  REQUIRE(fut.done());
  EXPECT_THROWS_AS(std::move(fut).value(), MessageTooLargeError);
  CHECK(w.conn->sent.empty());
  CHECK(w.in_flight() == 0);
}

TEST_CASE("CallEngine: a reply on a connection that carries none of our calls is a protocol error") {
  Wire w(64, /*dialed=*/false);
  w.reply(1, 1);
  CHECK(w.conn->closed);
  EXPECT_CONTAINS(w.conn->closed_why, "no calls of ours");
}

}  // namespace test_call_engine
