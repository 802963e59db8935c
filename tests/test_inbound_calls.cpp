// The requests a peer has running here (InboundCalls), in process, on the real table (no workers, no mocks): each
// request's stop token, stopped by a cancel for its id only, never by a stale id; cancel_all; the slot bound; and the
// table used from several threads at once.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <stop_token>
#include <thread>
#include <vector>

#include "../src/rpc/inbound_calls.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_inbound_calls {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {
std::uint64_t request_id(std::uint32_t generation, std::uint32_t slot) {
  return (std::uint64_t{generation} << 32) | slot;
}
}  // namespace

TEST_CASE("InboundCalls: cancel(id) stops that request's token only; after remove it stops nothing") {
  InboundCalls calls;
  const auto a = request_id(1, 0), b = request_id(1, 1), c = request_id(1, 2);
  std::stop_token ta = calls.add(a), tb = calls.add(b), tc = calls.add(c);
  CHECK(ta.stop_possible());
  CHECK(tb.stop_possible());
  CHECK_FALSE(ta.stop_requested());

  calls.cancel(a);
  CHECK(ta.stop_requested());
  CHECK_FALSE(tb.stop_requested());
  CHECK_FALSE(tc.stop_requested());

  // A cancel for an id that is not registered (another generation of a live slot, or an unused slot) stops nothing.
  calls.cancel(request_id(2, 1));
  calls.cancel(request_id(1, 7));
  calls.cancel(request_id(1, 5000));
  CHECK_FALSE(tb.stop_requested());
  CHECK_FALSE(tc.stop_requested());

  // The handler has finished: a late cancel frame reaches nobody.
  calls.remove(c);
  calls.cancel(c);
  CHECK_FALSE(tc.stop_requested());

  // Stop callbacks run on the cancelling thread, outside the table's lock: one may call back into the table.
  bool ran = false;
  std::stop_callback on_stop(tb, [&] {
    calls.remove(b);
    (void)calls.add(request_id(1, 3));
    ran = true;
  });
  auto cancelled = std::async(std::launch::async, [&] { calls.cancel(b); });
  REQUIRE(cancelled.wait_for(30s) == std::future_status::ready);  // a callback under the lock would deadlock here
  CHECK(ran);
  CHECK(tb.stop_requested());
}

TEST_CASE("InboundCalls: a newer request in a slot replaces the older; the older's id cancels or removes nothing") {
  InboundCalls calls;
  const auto old_id = request_id(1, 5), new_id = request_id(2, 5);
  std::stop_token old_token = calls.add(old_id);
  std::stop_token new_token = calls.add(new_id);
  calls.cancel(old_id);
  CHECK_FALSE(new_token.stop_requested());
  CHECK_FALSE(old_token.stop_requested());
  calls.remove(old_id);  // the old handler finishing must not unregister the new one
  calls.cancel(new_id);
  CHECK(new_token.stop_requested());
}

TEST_CASE("InboundCalls: cancel_all stops every live request and every later one; finished ones are left alone") {
  InboundCalls calls;
  std::stop_token t1 = calls.add(request_id(1, 0)), t2 = calls.add(request_id(1, 40)), t3 = calls.add(request_id(1, 2));
  calls.remove(request_id(1, 2));
  calls.cancel_all();
  CHECK(t1.stop_requested());
  CHECK(t2.stop_requested());
  CHECK_FALSE(t3.stop_requested());
  // The connection is gone: a request registered now starts stopped.
  std::stop_token late = calls.add(request_id(1, 9));
  CHECK(late.stop_possible());
  CHECK(late.stop_requested());
}

TEST_CASE("InboundCalls: a slot beyond the bound gets a token nothing can stop; the last slot within it works") {
  InboundCalls calls;
  std::stop_token beyond = calls.add(request_id(1, InboundCalls::kMaxSlots));
  CHECK_FALSE(beyond.stop_possible());
  calls.cancel(request_id(1, InboundCalls::kMaxSlots));
  CHECK_FALSE(beyond.stop_requested());
  std::stop_token last = calls.add(request_id(1, InboundCalls::kMaxSlots - 1));
  CHECK(last.stop_possible());
  std::stop_token first = calls.add(request_id(1, 0));  // after the table grew to its bound
  calls.cancel(request_id(1, InboundCalls::kMaxSlots - 1));
  CHECK(last.stop_requested());
  CHECK_FALSE(first.stop_requested());
  calls.cancel_all();
  CHECK(first.stop_requested());
  CHECK_FALSE(beyond.stop_requested());
}

TEST_CASE("InboundCalls: requests added, cancelled and removed from several threads at once") {
  // Each thread owns its slots; the table (and its growth) is shared. Every cancelled token must be stopped, every
  // other one not.
  InboundCalls calls;
  constexpr int kThreads = 4, kRounds = 2000;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const auto slot = static_cast<std::uint32_t>(t + kThreads * (i % 300));
        const auto id = request_id(static_cast<std::uint32_t>(i + 1), slot);
        std::stop_token token = calls.add(id);
        const bool cancel = i % 3 == 0;
        if (cancel) calls.cancel(id);
        if (token.stop_requested() != cancel) ++wrong;
        calls.remove(id);
        calls.cancel(id);  // after remove: a no-op
        if (token.stop_requested() != cancel) ++wrong;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(wrong.load() == 0);
}

}  // namespace test_inbound_calls
