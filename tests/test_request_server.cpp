// The request side (src/rpc/request_server.hpp) on its own, without sockets or workers: a connection that records
// what is sent plays the wire, a host of the test's plays the runtime (its own function table, world gate, worker pool
// and counts), and the test plays the caller by handing request and cancel frames to the frame dispatcher the request
// side registered its routes with. What is checked is what the caller would see (a reply, or an error frame that
// decodes to the typed error whose text names the function and the worker) and that every request ends in one answer
// and one count for graceful shutdown.
#include <doctest/doctest.h>

#include <deque>
#include <memory>
#include <stop_token>
#include <string>
#include <vector>

#include "corpc/rpc/detail/call.hpp"

#include "../src/rpc/call_engine.hpp"
#include "../src/rpc/error_frames.hpp"
#include "../src/rpc/rendezvous_state.hpp"
#include "../src/rpc/request_server.hpp"
#include "fake_connection.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_request_server {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;

namespace {

int add_ints(int a, int b) { return a + b; }

// A worker pool that runs nothing until the test says so.
struct HeldPool final : Executor {
  void enqueue(WorkItem* item) noexcept override { queued.push_back(item); }
  void run_all() {
    while (!queued.empty()) {
      WorkItem* w = queued.front();
      queued.pop_front();
      w->run(w);
    }
  }
  std::deque<WorkItem*> queued;
};

// The runtime as the request side (and the connection's call engine) sees it: worker "worker0" serving worker 1.
class TestHost final : public RequestHost, public CallHost {
 public:
  const std::string& self_name() const override { return self_; }
  std::string name_of(int rank) const override { return "worker" + std::to_string(rank); }
  const HandlerEntry* function(std::uint64_t id) const override { return functions.find(id); }
  bool park_until_world(const std::shared_ptr<Connection>& conn, Message& msg) override {
    return world.park_if_unknown(conn, msg);
  }
  OutFrame frame_for(Message&& m, int, Connection&) override { return prepare(std::move(m)); }
  void received_tensors(const FrameHeader&, int, std::vector<at::Tensor>&) override {}
  Activity& activity() override { return activity_; }
  Executor& pool() override { return pool_; }
  int autograd_context_slot() const override { return -1; }
  std::uint64_t max_request_bytes() const override { return 1000; }
  void arm_cancel(CancelSlot&, Connection&, std::uint64_t) override {}
  std::chrono::milliseconds default_timeout() const override { return std::chrono::seconds(60); }

  Registry functions;
  WorldGate world;
  HeldPool pool_;

 private:
  std::string self_ = "worker0";
  Activity activity_{2};
};

// Worker 1's connection to us (it dialed), the request side's routes, and a world table already known.
struct Server {
  TestHost host;
  RequestServer server{host};
  FrameDispatcher frames;
  asio::io_context io;
  std::shared_ptr<corpc::test::TableConnection> conn;
  explicit Server(bool world_known = true) {
    if (world_known) host.world.open();
    route_requests(frames, server);
    conn = std::make_shared<corpc::test::TableConnection>(io, "10.0.0.1:1",
                                                          CallEngine::factory(host, 64, /*dialed=*/false));
    conn->peer_rank = 1;
  }

  // Worker 1 asks for `function`(a, b), as request `id`, with the argument types `Args`.
  template <class Args = std::tuple<int, int>, class... A>
  void request(std::uint64_t id, const std::string& function, A... a) {
    Message m;
    encode_args<Args>(m, 0, a...);
    m.head.kind = FrameKind::Request;
    m.head.id = id;
    m.head.function = function_id(function);
    m.head.signature = signature_of<Args>();
    frames.dispatch(conn, std::move(m));
  }
  void cancel(std::uint64_t id) {
    Message m;
    m.head.kind = FrameKind::Request;
    m.head.flags = kFlagCancel;
    m.head.id = id;
    frames.dispatch(conn, std::move(m));
  }
  Activity& activity() { return host.activity(); }
};

// The value a Response frame carries.
int value_of(const OutFrame& f) {
  REQUIRE(f.head.kind == FrameKind::Response);
  Reader r(f.body.data(), f.body.size());
  return r.get<int>();
}
// Throws the error an Error frame carries, as the caller of `function` would see it.
void rethrow(const OutFrame& f, std::string_view function) {
  REQUIRE(f.head.kind == FrameKind::Error);
  Message m;
  m.head = f.head;
  m.body = f.body;
  std::rethrow_exception(decode_error(m, "worker0", function));
}

}  // namespace

TEST_CASE("RequestServer: a request runs its function and is answered with its value, counted once") {
  Server s;
  s.host.functions.add(make_entry<&add_ints>("add_ints", Execution::io_thread));
  s.request(7, "add_ints", 2, 3);
  REQUIRE(s.conn->sent.size() == 1);
  CHECK(s.conn->sent[0].head.id == 7);
  CHECK(value_of(s.conn->sent[0]) == 5);
  CHECK(s.activity().handled_counts()[1] == 1);
  CHECK(s.activity().handlers_running() == 0);
}

TEST_CASE("RequestServer: an unknown function is answered with UnknownFunctionError naming this worker") {
  Server s;
  s.request(3, "nowhere", 1, 2);
  REQUIRE(s.conn->sent.size() == 1);
  CHECK(s.conn->sent[0].head.id == 3);
  const std::string what = EXPECT_THROWS_AS(rethrow(s.conn->sent[0], "nowhere"), UnknownFunctionError);
  EXPECT_CONTAINS(what, "no function 'nowhere' is registered on worker 'worker0'");
  CHECK(s.activity().handled_counts()[1] == 1);  // refused, but answered: graceful shutdown balances it
  CHECK_FALSE(s.conn->closed);
}

TEST_CASE("RequestServer: arguments of other types are refused with ArgumentTypeError, the function not run") {
  Server s;
  s.host.functions.add(make_entry<&add_ints>("add_ints", Execution::io_thread));
  s.request<std::tuple<std::string>>(4, "add_ints", std::string("two"));
  REQUIRE(s.conn->sent.size() == 1);
  const std::string what = EXPECT_THROWS_AS(rethrow(s.conn->sent[0], "add_ints"), ArgumentTypeError);
  EXPECT_CONTAINS(what, "arguments do not match 'add_ints' on worker 'worker0', which takes");
  CHECK(s.activity().handled_counts()[1] == 1);
  CHECK(s.activity().handlers_running() == 0);
}

TEST_CASE("RequestServer: a request whose bytes were dropped for its size is answered with MessageTooLargeError") {
  Server s;
  Message m;
  m.head.kind = FrameKind::Request;
  m.head.id = 5;
  m.head.body_len = 5000;
  s.conn->deliver_refused(true);  // the transport kept only its header
  s.frames.dispatch(s.conn, std::move(m));
  s.conn->deliver_refused(false);
  REQUIRE(s.conn->sent.size() == 1);
  const std::string what = EXPECT_THROWS_AS(rethrow(s.conn->sent[0], "f"), MessageTooLargeError);
  EXPECT_CONTAINS(what, "is over the 1000 that worker 'worker0' may hold");
  CHECK(s.activity().handled_counts()[1] == 1);
  CHECK_FALSE(s.conn->closed);
}

TEST_CASE("RequestServer: a cancel stops a running request's token; its handler's answer still ends it once") {
  Server s;
  std::stop_token seen;
  Promise<Message> result;
  s.host.functions.add(typed_entry<std::tuple<int, int>>(
      "slow",
      [&](Inbound&) {
        seen = current_call_context().stop;
        return result.get_future();
      },
      Execution::io_thread));
  s.request(9, "slow", 1, 2);
  CHECK(s.conn->sent.empty());
  REQUIRE(seen.stop_possible());
  CHECK_FALSE(seen.stop_requested());
  CHECK(s.activity().handlers_running() == 1);
  s.cancel(9);
  CHECK(seen.stop_requested());
  CHECK(s.conn->sent.empty());  // the cancel itself is not answered
  result.set_exception(cancelled_error());
  REQUIRE(s.conn->sent.size() == 1);
  EXPECT_CONTAINS(EXPECT_THROWS_AS(rethrow(s.conn->sent[0], "slow"), RemoteError), "corpc::CancelledError: cancelled");
  CHECK(s.activity().handlers_running() == 0);
  CHECK(s.activity().handled_counts()[1] == 1);
}

TEST_CASE("RequestServer: a request cancelled while queued for the pool is answered with CancelledError, not run") {
  Server s;
  int runs = 0;
  s.host.functions.add(typed_entry<std::tuple<int, int>>(
      "pooled",
      [&](Inbound&) {
        ++runs;
        return make_ready_future(encode_reply(1, 1));
      },
      Execution::worker_pool));
  s.request(11, "pooled", 1, 2);
  CHECK(s.host.pool_.queued.size() == 1);
  s.cancel(11);
  s.host.pool_.run_all();
  CHECK(runs == 0);
  REQUIRE(s.conn->sent.size() == 1);
  EXPECT_CONTAINS(EXPECT_THROWS_AS(rethrow(s.conn->sent[0], "pooled"), RemoteError),
                  "corpc::CancelledError: cancelled");
  CHECK(s.activity().handlers_running() == 0);
}

TEST_CASE("RequestServer: a request before the world table waits for it, then runs in order with its cancel") {
  Server s(/*world_known=*/false);
  s.host.functions.add(make_entry<&add_ints>("add_ints", Execution::io_thread));
  s.request(1, "add_ints", 1, 1);
  s.request(2, "add_ints", 2, 2);
  CHECK(s.conn->sent.empty());  // parked: neither run nor refused
  CHECK_FALSE(s.conn->closed);
  const auto waiting = s.host.world.open();
  REQUIRE(waiting.size() == 1);
  for (auto& m : s.host.world.take(*waiting[0])) s.frames.dispatch(waiting[0], std::move(m));
  REQUIRE(s.conn->sent.size() == 2);
  CHECK(s.conn->sent[0].head.id == 1);
  CHECK(value_of(s.conn->sent[0]) == 2);
  CHECK(value_of(s.conn->sent[1]) == 4);
}

TEST_CASE("RequestServer: a request on a connection whose sender never said who it is closes it") {
  Server s;
  s.conn->peer_rank = -1;
  s.host.functions.add(make_entry<&add_ints>("add_ints", Execution::io_thread));
  s.request(1, "add_ints", 1, 1);
  CHECK(s.conn->sent.empty());
  CHECK(s.conn->closed);
  CHECK(s.conn->closed_why == "protocol error: a request before hello");
}

}  // namespace test_request_server
