// The runtime's bookkeeping tables, in process, on real objects (no workers, no mocks): the calls a connection has in
// flight (PendingCalls: ids with generations, deadlines, the per-peer limit), the requests a peer has running here
// (InboundCalls: their stop tokens), the receive budget (ReceiveBudget, and its per-connection share as a TCP
// connection applies it over a real socket pair), and the function registry (Registry: lookups, replacement, hash
// collisions, snapshots read while another thread registers).
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <mutex>
#include <random>
#include <set>
#include <stop_token>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "../src/rpc/inbound_calls.hpp"
#include "../src/rpc/peer_table.hpp"
#include "../src/rpc/pending_calls.hpp"
#include "../src/rpc/rendezvous_state.hpp"
#include "../src/transport/connection.hpp"
#include "../src/transport/receive_budget.hpp"
#include "../src/transport/stream.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_call_tables {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------------------------------------------------------
// PendingCalls

// What a call's completion reported (PendingCall::finish).
struct Completion {
  void* target = nullptr;
  int dst = -1;
  Message* reply = nullptr;
  bool failed = false;
};
std::vector<Completion> g_completions;
void record_completion(void* target, int dst, Message* reply, std::exception_ptr error) noexcept {
  g_completions.push_back({target, dst, reply, error != nullptr});
}

// A call whose `dst` is used as its tag, due at `deadline`.
PendingCall make_call(int tag, Clock::time_point deadline) {
  PendingCall c;
  c.complete = &record_completion;
  c.function = "corpc.test.f";
  c.owned_name = "call " + std::to_string(tag);
  c.deadline = deadline;
  c.timeout = 1000ms;
  c.dst = tag;
  return c;
}

struct Added {
  std::uint64_t id = 0;
  bool earliest_changed = false;
  bool send_now = false;
  OutFrame frame;  // as `add` left it: stamped with the id, or moved into the queue (send_now false)
};

// Adds call `tag` with a frame whose body names it (so that a frame handed back says which call it belongs to).
Added add_call(PendingCalls& p, int tag, Clock::time_point deadline, bool limited = true, bool block = false) {
  Added a;
  a.frame.body = "frame " + std::to_string(tag);
  a.id = p.add(make_call(tag, deadline), a.frame, limited, block, &a.earliest_changed, &a.send_now);
  return a;
}

bool is_id(std::uint64_t id) { return id != PendingCalls::kClosed && id != PendingCalls::kNoRoom; }
std::uint32_t slot_of(std::uint64_t id) { return static_cast<std::uint32_t>(id & 0xffffffffu); }
std::uint32_t generation_of(std::uint64_t id) { return static_cast<std::uint32_t>(id >> 32); }

std::vector<std::string> bodies(const std::vector<OutFrame>& frames) {
  std::vector<std::string> out;
  for (auto& f : frames) out.push_back(f.body);
  return out;
}
std::vector<int> tags(const std::vector<PendingCall>& calls) {
  std::vector<int> out;
  for (auto& c : calls) out.push_back(c.dst);
  return out;
}

}  // namespace

TEST_CASE("PendingCalls: a reply finds its call by id, once; an id never issued is told apart from a late one") {
  PendingCalls p;
  const auto far = Clock::now() + 1h;
  Added a = add_call(p, 1, far), b = add_call(p, 2, far), c = add_call(p, 3, far);
  for (auto* x : {&a, &b, &c}) {
    CHECK(is_id(x->id));
    CHECK(x->send_now);                // no limit set
    CHECK(x->frame.head.id == x->id);  // the frame carries the id the reply will echo
  }
  CHECK(a.id != b.id);
  CHECK(b.id != c.id);
  CHECK(a.id != c.id);
  CHECK(p.size() == 3);
  CHECK(p.waiting() == 0);

  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(b.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(out.dst == 2);
  CHECK(out.owned_name == "call 2");
  CHECK(out.id == b.id);
  CHECK(ready.empty());
  CHECK(p.size() == 2);
  // The same reply again (a duplicate, or the reply after a timeout took the call): late, and nothing is taken.
  PendingCall again;
  CHECK(p.take(b.id, again, ready) == PendingCalls::Lookup::Late);
  CHECK(again.dst == -1);
  CHECK(p.size() == 2);

  // Ids this connection never issued: a slot it never used, generation 0, a generation ahead of the slot's.
  CHECK(p.take((std::uint64_t{1} << 32) | 1000, again, ready) == PendingCalls::Lookup::NeverIssued);
  CHECK(p.take(slot_of(a.id), again, ready) == PendingCalls::Lookup::NeverIssued);
  CHECK(p.take((std::uint64_t{generation_of(a.id) + 1} << 32) | slot_of(a.id), again, ready) ==
        PendingCalls::Lookup::NeverIssued);
  CHECK(p.take(PendingCalls::kClosed, again, ready) == PendingCalls::Lookup::NeverIssued);
  CHECK(p.take(PendingCalls::kNoRoom, again, ready) == PendingCalls::Lookup::NeverIssued);
  CHECK(p.size() == 2);

  // What was taken completes through its own callback, with its own destination.
  g_completions.clear();
  int target = 0;
  out.target = &target;
  Message reply;
  out.finish(&reply, nullptr);
  REQUIRE(g_completions.size() == 1);
  CHECK(g_completions[0].target == &target);
  CHECK(g_completions[0].dst == 2);
  CHECK(g_completions[0].reply == &reply);
  CHECK_FALSE(g_completions[0].failed);
  g_completions.clear();
}

TEST_CASE("PendingCalls: a reused slot gets a new generation, so a stale id never finds the call that holds it now") {
  PendingCalls p;
  const auto far = Clock::now() + 1h;
  Added first = add_call(p, 1, far);
  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(first.id, out, ready) == PendingCalls::Lookup::Found);

  Added second = add_call(p, 2, far);
  REQUIRE(is_id(second.id));
  CHECK(slot_of(second.id) == slot_of(first.id));  // the freed slot is reused: the table stays at the peak
  CHECK(second.id != first.id);
  CHECK(generation_of(second.id) > generation_of(first.id));
  // A late reply to the first call must not complete the second.
  CHECK(p.take(first.id, out, ready) == PendingCalls::Lookup::Late);
  CHECK(p.size() == 1);
  REQUIRE(p.take(second.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(out.dst == 2);

  // The same after a timeout took the call: its slot goes to the next call, the timed-out id stays late.
  const auto t0 = Clock::now();
  Added timed_out = add_call(p, 3, t0 + 1ms);
  std::vector<PendingCall> expired;
  p.take_expired(t0 + 1ms, expired, ready);
  REQUIRE(tags(expired) == std::vector<int>{3});
  Added third = add_call(p, 4, far);
  CHECK(slot_of(third.id) == slot_of(timed_out.id));
  CHECK(p.take(timed_out.id, out, ready) == PendingCalls::Lookup::Late);
  REQUIRE(p.take(third.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(out.dst == 4);
}

TEST_CASE("PendingCalls: deadlines: earliest() is the soonest, take_expired takes those due, soonest first") {
  PendingCalls p;
  CHECK(p.earliest() == Clock::time_point::max());
  std::vector<PendingCall> expired;
  std::vector<OutFrame> ready;
  p.take_expired(Clock::time_point::max(), expired, ready);  // nothing registered: nothing taken
  CHECK(expired.empty());

  const auto t0 = Clock::now();
  Added a = add_call(p, 30, t0 + 30ms);
  CHECK(a.earliest_changed);  // the first deadline is the earliest
  Added b = add_call(p, 10, t0 + 10ms);
  CHECK(b.earliest_changed);
  Added c = add_call(p, 20, t0 + 20ms);
  CHECK_FALSE(c.earliest_changed);
  Added d = add_call(p, 40, t0 + 40ms);
  CHECK_FALSE(d.earliest_changed);
  CHECK(p.earliest() == t0 + 10ms);

  p.take_expired(t0 + 5ms, expired, ready);
  CHECK(expired.empty());
  CHECK(p.size() == 4);
  // Due at or before `now`: 10 and 20 (20 exactly at now), in deadline order.
  p.take_expired(t0 + 20ms, expired, ready);
  CHECK(tags(expired) == std::vector<int>{10, 20});
  CHECK(expired[0].id == b.id);
  CHECK(p.size() == 2);
  CHECK(p.earliest() == t0 + 30ms);
  PendingCall out;
  CHECK(p.take(b.id, out, ready) == PendingCalls::Lookup::Late);  // its reply, after the timeout

  // A reply takes the earliest: the next one is the earliest now.
  REQUIRE(p.take(a.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(p.earliest() == t0 + 40ms);
  expired.clear();
  p.take_expired(Clock::time_point::max(), expired, ready);
  CHECK(tags(expired) == std::vector<int>{40});
  CHECK(p.earliest() == Clock::time_point::max());
  CHECK(p.size() == 0);
}

TEST_CASE("PendingCalls: replies taken from the middle keep the deadline order of the rest") {
  // Many calls with shuffled deadlines, half answered in random order: take_expired must return exactly the others,
  // soonest first, and earliest() must always be the soonest left.
  PendingCalls p;
  std::mt19937 rng(7);
  const auto t0 = Clock::now();
  std::vector<int> order(300);
  for (int i = 0; i < 300; ++i) order[static_cast<std::size_t>(i)] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::uint64_t> ids(300);
  for (int tag : order) ids[static_cast<std::size_t>(tag)] = add_call(p, tag, t0 + std::chrono::milliseconds(tag)).id;
  std::shuffle(order.begin(), order.end(), rng);
  std::set<int> left(order.begin(), order.end());
  std::vector<OutFrame> ready;
  for (std::size_t i = 0; i < 150; ++i) {
    PendingCall out;
    REQUIRE(p.take(ids[static_cast<std::size_t>(order[i])], out, ready) == PendingCalls::Lookup::Found);
    CHECK(out.dst == order[i]);
    left.erase(order[i]);
    CHECK(p.earliest() == t0 + std::chrono::milliseconds(*left.begin()));
  }
  std::vector<PendingCall> expired;
  p.take_expired(t0 + 150ms, expired, ready);  // about half of the rest is due
  std::vector<int> want;
  for (int tag : left)
    if (tag <= 150) want.push_back(tag);
  CHECK(tags(expired) == want);
  expired.clear();
  p.take_expired(Clock::time_point::max(), expired, ready);
  want.clear();
  for (int tag : left)
    if (tag > 150) want.push_back(tag);
  CHECK(tags(expired) == want);
  CHECK(p.size() == 0);
}

TEST_CASE("PendingCalls: calls beyond the per-peer limit wait with their frames, in order, until replies free room") {
  PendingCalls p;
  p.set_limit(2);
  const auto far = Clock::now() + 1h;
  Added c1 = add_call(p, 1, far), c2 = add_call(p, 2, far);
  CHECK(c1.send_now);
  CHECK(c2.send_now);
  Added c3 = add_call(p, 3, far), c4 = add_call(p, 4, far);
  CHECK(is_id(c3.id));  // registered (its deadline runs), not sent
  CHECK(is_id(c4.id));
  CHECK_FALSE(c3.send_now);
  CHECK_FALSE(c4.send_now);
  CHECK(p.waiting() == 2);
  CHECK(p.size() == 4);
  // corpc's own control calls do not count against the limit and do not queue behind it.
  Added control = add_call(p, 99, far, /*limited=*/false);
  CHECK(control.send_now);
  CHECK(control.frame.head.id == control.id);
  CHECK(p.waiting() == 2);

  // A reply frees room: the oldest waiting call's frame comes back, stamped with its id, to be sent.
  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(c1.id, out, ready) == PendingCalls::Lookup::Found);
  REQUIRE(bodies(ready) == std::vector<std::string>{"frame 3"});
  CHECK(ready[0].head.id == c3.id);
  CHECK(p.waiting() == 1);
  // The control call's reply frees nothing: it never held room.
  ready.clear();
  REQUIRE(p.take(control.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(ready.empty());
  CHECK(p.waiting() == 1);
  // A new call may not overtake the one still waiting.
  Added c5 = add_call(p, 5, far);
  CHECK_FALSE(c5.send_now);
  CHECK(p.waiting() == 2);

  REQUIRE(p.take(c2.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 4"});
  ready.clear();
  REQUIRE(p.take(c3.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 5"});
  ready.clear();
  // c4 and c5 in flight: the limit is full again.
  Added c6 = add_call(p, 6, far);
  CHECK_FALSE(c6.send_now);
  REQUIRE(p.take(c4.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 6"});
  ready.clear();
  REQUIRE(p.take(c5.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(ready.empty());
  CHECK(p.waiting() == 0);
  // One in flight (c6), room for one more.
  Added c7 = add_call(p, 7, far);
  CHECK(c7.send_now);
}

TEST_CASE("PendingCalls: calls registered after the limit was raised still go after those already waiting") {
  PendingCalls p;
  p.set_limit(2);
  const auto far = Clock::now() + 1h;
  Added c1 = add_call(p, 1, far);
  add_call(p, 2, far);
  Added c3 = add_call(p, 3, far);
  REQUIRE_FALSE(c3.send_now);
  p.set_limit(3);  // room for one more, while c3 waits
  Added c4 = add_call(p, 4, far);
  CHECK_FALSE(c4.send_now);  // it may not overtake c3
  CHECK(p.waiting() == 2);
  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(c1.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 3", "frame 4"});  // in order, up to the new limit
  CHECK(p.waiting() == 0);
}

TEST_CASE("PendingCalls: a limit of 0 means 1") {
  PendingCalls p;
  p.set_limit(0);
  const auto far = Clock::now() + 1h;
  Added a = add_call(p, 1, far);
  Added b = add_call(p, 2, far);
  CHECK(a.send_now);
  CHECK_FALSE(b.send_now);
  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(a.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 2"});
}

TEST_CASE("PendingCalls: a waiting call that times out is never sent; a sent one that times out frees its room") {
  PendingCalls p;
  p.set_limit(1);
  const auto t0 = Clock::now();
  const auto far = t0 + 1h;
  Added sent = add_call(p, 1, far);
  Added soon = add_call(p, 2, t0 + 5ms);
  Added later = add_call(p, 3, far);
  REQUIRE(sent.send_now);
  REQUIRE_FALSE(soon.send_now);
  REQUIRE_FALSE(later.send_now);
  std::vector<PendingCall> expired;
  std::vector<OutFrame> ready;
  p.take_expired(t0 + 5ms, expired, ready);
  CHECK(tags(expired) == std::vector<int>{2});
  CHECK(ready.empty());  // the limit is still full
  PendingCall out;
  REQUIRE(p.take(sent.id, out, ready) == PendingCalls::Lookup::Found);
  CHECK(bodies(ready) == std::vector<std::string>{"frame 3"});  // the timed-out call's frame is skipped
  ready.clear();

  // A call in flight and one waiting, both due: both are taken, nothing is left to send.
  Added next = add_call(p, 4, far + 1ms);
  REQUIRE_FALSE(next.send_now);
  expired.clear();
  p.take_expired(far + 1ms, expired, ready);  // `later` (in flight) and `next` (waiting): both due
  CHECK(tags(expired) == std::vector<int>{3, 4});
  CHECK(ready.empty());
  expired.clear();
  // The call in flight times out: its room goes to the next waiting call.
  Added a = add_call(p, 5, t0 + 10ms);  // in flight alone
  REQUIRE(a.send_now);
  Added b = add_call(p, 6, far + 1h);
  REQUIRE_FALSE(b.send_now);
  p.take_expired(t0 + 10ms, expired, ready);
  CHECK(tags(expired) == std::vector<int>{5});
  CHECK(bodies(ready) == std::vector<std::string>{"frame 6"});
  CHECK(ready[0].head.id == b.id);
}

TEST_CASE("PendingCalls: a caller that blocks for room goes when a reply frees it, or gets kNoRoom at its deadline") {
  PendingCalls p;
  p.set_limit(1);
  const auto far = Clock::now() + 1h;
  Added first = add_call(p, 1, far);
  REQUIRE(first.send_now);

  std::atomic<bool> returned{false};
  Added blocked;
  std::thread caller([&] {
    blocked = add_call(p, 2, Clock::now() + 60s, /*limited=*/true, /*block=*/true);
    returned = true;
  });
  std::this_thread::sleep_for(100ms);
  CHECK_FALSE(returned.load());  // no room: it waits instead of queueing its frame
  CHECK(p.waiting() == 0);
  PendingCall out;
  std::vector<OutFrame> ready;
  REQUIRE(p.take(first.id, out, ready) == PendingCalls::Lookup::Found);
  caller.join();
  CHECK(returned.load());
  CHECK(is_id(blocked.id));
  CHECK(blocked.send_now);  // it sends its own frame
  CHECK(blocked.frame.head.id == blocked.id);
  CHECK(ready.empty());  // nothing was queued here for it
  CHECK(p.size() == 1);

  // No room before its deadline: not registered, the frame untouched.
  const auto deadline = Clock::now() + 50ms;
  Added refused = add_call(p, 3, deadline, true, true);
  CHECK(refused.id == PendingCalls::kNoRoom);
  CHECK(Clock::now() >= deadline);  // it waited for room until the deadline
  CHECK(refused.frame.head.id == 0);
  CHECK(p.size() == 1);
  CHECK(p.waiting() == 0);
}

TEST_CASE("PendingCalls: close_and_take_all hands back every call, waiting ones too; later calls get kClosed") {
  PendingCalls p;
  p.set_limit(1);
  const auto far = Clock::now() + 1h;
  Added sent = add_call(p, 1, far), queued = add_call(p, 2, far), control = add_call(p, 3, far, false);
  REQUIRE(p.waiting() == 1);

  // A caller blocked for room is released by the close, with kClosed.
  std::promise<std::uint64_t> blocked_id;
  std::thread caller([&] { blocked_id.set_value(add_call(p, 4, Clock::now() + 60s, true, true).id); });
  auto blocked = blocked_id.get_future();
  CHECK(blocked.wait_for(100ms) == std::future_status::timeout);

  std::vector<PendingCall> all;
  p.close_and_take_all(all);
  REQUIRE(blocked.wait_for(30s) == std::future_status::ready);
  caller.join();
  CHECK(blocked.get() == PendingCalls::kClosed);
  auto got = tags(all);
  std::sort(got.begin(), got.end());
  CHECK(got == std::vector<int>{1, 2, 3});
  CHECK(p.size() == 0);
  CHECK(p.waiting() == 0);
  CHECK(p.earliest() == Clock::time_point::max());

  // After the close: the call is not taken (the caller still holds it, to fail it itself), the frame not stamped.
  PendingCall refused = make_call(5, far);
  OutFrame frame;
  bool earliest_changed = false, send_now = false;
  CHECK(p.add(std::move(refused), frame, true, false, &earliest_changed, &send_now) == PendingCalls::kClosed);
  CHECK(refused.owned_name == "call 5");  // NOLINT(bugprone-use-after-move): add did not take it
  CHECK(frame.head.id == 0);
  CHECK(p.add(make_call(6, far), frame, false, false, &earliest_changed, &send_now) == PendingCalls::kClosed);
  CHECK(p.size() == 0);
  // Replies that arrive after the close are late, not strangers.
  PendingCall out;
  std::vector<OutFrame> ready;
  CHECK(p.take(sent.id, out, ready) == PendingCalls::Lookup::Late);
  CHECK(p.take(queued.id, out, ready) == PendingCalls::Lookup::Late);
  CHECK(p.take(control.id, out, ready) == PendingCalls::Lookup::Late);
  CHECK(ready.empty());
  std::vector<PendingCall> expired;
  p.take_expired(Clock::time_point::max(), expired, ready);
  CHECK(expired.empty());
  CHECK(ready.empty());
}

// ---------------------------------------------------------------------------------------------------------------
// InboundCalls

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

// ---------------------------------------------------------------------------------------------------------------
// ReceiveBudget

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

// ---------------------------------------------------------------------------------------------------------------
// Registry

namespace {

int add_ints(int a, int b) { return a + b; }
void no_op(Inbound&, Message&) {}

HandlerEntry entry(std::string name, std::uint64_t signature = 0, Execution execution = Execution::worker_pool) {
  HandlerEntry e;
  e.name = std::move(name);
  e.signature = signature;
  e.signature_text = std::to_string(signature);
  e.execution = execution;
  e.run_sync = &no_op;
  return e;
}

// Two names with the same 64-bit FNV-1a hash (found by lattice reduction over the hash's multiplier).
constexpr std::string_view kCollidingA = "R369pZl-U:1CZ.";
constexpr std::string_view kCollidingB = "_Z222Te:cu8HQ3";

}  // namespace

TEST_CASE("Registry: an entry is found by the id of its name; add sets the id; absent ids find nothing") {
  Registry r;
  CHECK(r.find(function_id("corpc.test.alpha")) == nullptr);  // empty: no snapshot yet
  HandlerEntry alpha = entry("corpc.test.alpha", 7, Execution::io_thread);
  alpha.id = 12345;  // whatever the entry says, the id is the name's
  r.add(std::move(alpha));
  const HandlerEntry* found = r.find(function_id("corpc.test.alpha"));
  REQUIRE(found != nullptr);
  CHECK(found->name == "corpc.test.alpha");
  CHECK(found->id == function_id("corpc.test.alpha"));
  CHECK(found->signature == 7);
  CHECK(found->execution == Execution::io_thread);
  CHECK((found->run_sync == &no_op));
  CHECK(r.find(12345) == nullptr);
  CHECK(r.find(function_id("corpc.test.beta")) == nullptr);

  // Many entries, registered in shuffled order: each is found under its own id, nothing else is.
  std::vector<std::string> names;
  for (int i = 0; i < 200; ++i) names.push_back("corpc.test.fn" + std::to_string(i));
  std::vector<std::string> shuffled = names;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
  for (auto& n : shuffled) r.add(entry(n, function_id(n) ^ 1));
  for (auto& n : names) {
    const HandlerEntry* e = r.find(function_id(n));
    REQUIRE(e != nullptr);
    CHECK(e->name == n);
    CHECK(e->signature == (function_id(n) ^ 1));
  }
  CHECK(r.find(function_id("corpc.test.fn200")) == nullptr);
  CHECK(r.find(0) == nullptr);
  CHECK(r.find(~std::uint64_t{0}) == nullptr);
  CHECK(r.find(function_id("corpc.test.alpha")) != nullptr);
}

TEST_CASE("Registry: registering a name again replaces its entry; a pointer found before stays valid and unchanged") {
  Registry r;
  r.add(entry("corpc.test.f", 1, Execution::worker_pool));
  r.add(entry("corpc.test.g", 5));
  const HandlerEntry* before = r.find(function_id("corpc.test.f"));
  REQUIRE(before != nullptr);
  r.add(entry("corpc.test.f", 2, Execution::io_thread));
  const HandlerEntry* after = r.find(function_id("corpc.test.f"));
  REQUIRE(after != nullptr);
  CHECK(after->signature == 2);
  CHECK(after->execution == Execution::io_thread);
  // A reader that found the entry before the replacement still reads the old one, whole (snapshots are never freed).
  CHECK(before->name == "corpc.test.f");
  CHECK(before->signature == 1);
  CHECK(before->signature_text == "1");
  CHECK(before->execution == Execution::worker_pool);
  // The other entries are untouched.
  const HandlerEntry* g = r.find(function_id("corpc.test.g"));
  REQUIRE(g != nullptr);
  CHECK(g->signature == 5);
}

TEST_CASE("Registry: a second name with the same id is refused with UsageError naming both; the first stays") {
  REQUIRE(kCollidingA != kCollidingB);
  REQUIRE(function_id(kCollidingA) == function_id(kCollidingB));
  Registry r;
  r.add(entry(std::string(kCollidingA), 1));
  try {
    r.add(entry(std::string(kCollidingB), 2));
    FAIL("a colliding name was accepted");
  } catch (const UsageError& e) {
    const std::string what = e.what();
    CHECK(what.find(std::string(kCollidingA)) != std::string::npos);
    CHECK(what.find(std::string(kCollidingB)) != std::string::npos);
  }
  const HandlerEntry* e = r.find(function_id(kCollidingA));
  REQUIRE(e != nullptr);
  CHECK(e->name == kCollidingA);
  CHECK(e->signature == 1);
  // The refusal published nothing: the first name can still be replaced, and the table still grows.
  r.add(entry(std::string(kCollidingA), 3));
  r.add(entry("corpc.test.other", 4));
  CHECK(r.find(function_id(kCollidingA))->signature == 3);
  CHECK(r.find(function_id("corpc.test.other")) != nullptr);
}

TEST_CASE("Registry: lookups while another thread registers see whole snapshots that only grow") {
  // The writer registers n0, n1, ... in order and keeps replacing "hot" (its signature and text agree in each
  // version). A reader that finds n_k must then find every n_j, j < k (later snapshots contain earlier ones), must
  // never lose a name it saw, and must never see a torn entry.
  Registry r;
  constexpr int kNames = 400;
  std::vector<std::string> names;
  for (int i = 0; i < kNames; ++i) names.push_back("corpc.test.n" + std::to_string(i));
  r.add(entry("corpc.test.hot", 0));
  std::atomic<bool> done{false};
  std::atomic<int> wrong{0}, reads{0};
  auto reader = [&] {
    int seen = -1;
    while (!done.load()) {
      int highest = -1;
      for (int i = kNames - 1; i >= 0; --i) {
        if (const HandlerEntry* e = r.find(function_id(names[static_cast<std::size_t>(i)]))) {
          if (e->name != names[static_cast<std::size_t>(i)]) ++wrong;
          highest = i;
          break;
        }
      }
      if (highest < seen) ++wrong;  // a registered name disappeared
      seen = std::max(seen, highest);
      for (int j = 0; j < highest; ++j)
        if (r.find(function_id(names[static_cast<std::size_t>(j)])) == nullptr) ++wrong;
      const HandlerEntry* hot = r.find(function_id("corpc.test.hot"));
      if (!hot || hot->signature_text != std::to_string(hot->signature)) ++wrong;
      ++reads;
    }
  };
  // Every 50 names the writer waits (bounded) for the readers to finish a few passes, so that reads interleave with
  // the registrations however the threads are scheduled.
  auto let_readers_read = [&] {
    const int at = reads.load();
    const auto until = std::chrono::steady_clock::now() + 10s;
    while (reads.load() < at + 4 && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  };
  std::thread r1(reader), r2(reader);
  let_readers_read();
  const int reads_before = reads.load();
  for (int i = 0; i < kNames; ++i) {
    r.add(entry(names[static_cast<std::size_t>(i)], static_cast<std::uint64_t>(i)));
    r.add(entry("corpc.test.hot", static_cast<std::uint64_t>(i + 1)));
    if (i % 50 == 25) let_readers_read();
  }
  const int reads_while_writing = reads.load() - reads_before;
  done = true;
  r1.join();
  r2.join();
  CHECK(wrong.load() == 0);
  CHECK(reads_while_writing >= 8 * 4);  // the readers really did read while the table changed
  for (auto& n : names) CHECK(r.find(function_id(n)) != nullptr);
  CHECK(r.find(function_id("corpc.test.hot"))->signature == std::uint64_t{kNames});
}

TEST_CASE("register_function adds an entry to the global registry that decodes its arguments and runs the function") {
  const std::string name = "corpc.test.add_ints";
  CHECK(global_registry().find(function_id(name)) == nullptr);
  register_function<&add_ints>(name, Execution::io_thread);
  const HandlerEntry* e = global_registry().find(function_id(name));
  REQUIRE(e != nullptr);
  CHECK(e->name == name);
  CHECK(e->execution == Execution::io_thread);
  CHECK(e->signature == corpc::detail::signature_of<std::tuple<int, int>>());
  REQUIRE((e->run_sync != nullptr));

  Message request;
  corpc::detail::encode_args<std::tuple<int, int>>(request, 0, 20, 22);
  Inbound in{0, e->name, Reader(request.body.data(), request.body.size()), &request};
  in.args.tensors = &request.tensors;
  Message reply;
  e->run_sync(in, reply);
  Reader result(reply.body.data(), reply.body.size());
  CHECK(result.get<int>() == 42);
}

// ---------------------------------------------------------------------------------------------------------------
// PeerTable, Registrations, WorldGate

namespace {

// A connection that only holds what the tables read: its rank, its direction, its address.
class TableConnection final : public Connection {
 public:
  TableConnection(asio::io_context& io, std::string address, bool dialed = false) : Connection(io, {}) {
    remote_address = std::move(address);
    outgoing = dialed;
  }
  void send(OutFrame&&) override {}
  void close(std::string) override {}
  void close_when_flushed() override {}
};

std::shared_ptr<Connection> table_connection(asio::io_context& io, std::string address, bool dialed = false) {
  return std::make_shared<TableConnection>(io, std::move(address), dialed);
}

WorkerInfo worker(std::string name, int rank) {
  WorkerInfo w;
  w.name = std::move(name);
  w.rank = rank;
  return w;
}

}  // namespace

TEST_CASE("PeerTable: one connection speaks for a rank; a claimant is refused while it lives, admitted after it goes") {
  asio::io_context io;
  PeerTable table(3);
  auto first = table_connection(io, "10.0.0.1");
  auto second = table_connection(io, "10.0.0.2");
  int admitted = 0;
  CHECK_FALSE(table.claim(1, first, [&] { ++admitted; }).has_value());
  CHECK(admitted == 1);
  CHECK(first->peer_rank == 1);
  auto refusal = table.claim(1, second, [&] { ++admitted; });
  REQUIRE(refusal.has_value());
  CHECK(refusal->find("rank 1 is already connected here (from 10.0.0.1)") != std::string::npos);
  CHECK(admitted == 1);  // nothing recorded for the refused one
  CHECK(second->peer_rank == -1);
  CHECK_FALSE(table.claim(2, second).has_value());  // another rank is free
  // The loss of a connection that does not speak for the rank is its own: the holder stays.
  auto stranger = table_connection(io, "10.0.0.3");
  stranger->peer_rank = 1;
  CHECK_FALSE(table.remove(stranger).speaks_for_rank);
  CHECK(table.claim(1, table_connection(io, "10.0.0.4")).has_value());
  // The holder's loss is the rank's, and frees it.
  auto loss = table.remove(first);
  CHECK(loss.speaks_for_rank);
  CHECK_FALSE(loss.while_closing);
  CHECK_FALSE(table.claim(1, table_connection(io, "10.0.0.5")).has_value());
}

TEST_CASE("PeerTable: our connection is dialed once; a dead rank refuses calls with why; closing refuses everything") {
  asio::io_context io;
  PeerTable table(2);
  int dials = 0;
  auto dial = [&](const PeerTable::Address* moved) {
    CHECK(moved == nullptr);  // nobody rejoined
    ++dials;
    auto c = table_connection(io, "10.0.0.1", true);
    c->peer_rank = 1;
    return c;
  };
  auto ours = table.outgoing_to(1, "w1", dial);
  CHECK(table.outgoing_to(1, "w1", dial) == ours);
  CHECK(dials == 1);
  CHECK(table.outgoing_if(1, ours.get()) == ours);
  CHECK(table.outgoing_if(1, nullptr) == nullptr);
  CHECK(table.outgoing_if(7, ours.get()) == nullptr);
  CHECK(table.outgoing_connections().size() == 1);
  CHECK(table.is_alive(1));
  CHECK_FALSE(table.is_alive(2));
  CHECK_FALSE(table.is_alive(-1));

  auto news = table.mark_dead(1, "it went silent");
  REQUIRE(news.has_value());
  CHECK(*news == ours);                                  // to be closed by the caller
  CHECK_FALSE(table.mark_dead(1, "again").has_value());  // not news
  CHECK_FALSE(table.is_alive(1));
  CHECK(table.deaths() == std::vector<std::string>{"", "it went silent"});
  try {
    table.outgoing_to(1, "w1", dial);
    FAIL("a dead rank was dialed");
  } catch (const ConnectionError& e) {
    CHECK(std::string(e.what()).find("worker 'w1' (rank 1) is gone: it went silent") != std::string::npos);
  }
  CHECK(dials == 1);
  // Our connection's loss is always the rank's; it is forgotten.
  CHECK(table.remove(ours).speaks_for_rank);
  CHECK(table.outgoing_connections().empty());

  table.set_farewell(0, "out of memory");
  table.set_farewell(5, "ignored: no such rank");
  CHECK(table.farewell(0) == "out of memory");
  CHECK(table.farewell(5).empty());

  auto accepted = table_connection(io, "10.0.0.9");
  CHECK(table.add_incoming(accepted));
  CHECK(table.any_open(0));
  auto all = table.close();
  CHECK(all == std::vector<std::shared_ptr<Connection>>{accepted});
  CHECK_FALSE(table.add_incoming(table_connection(io, "10.0.0.10")));
  CHECK_THROWS_AS(table.outgoing_to(0, "w0", dial), ShutdownError);
  CHECK(table.remove(accepted).while_closing);
  CHECK_FALSE(table.any_open(0));
}

TEST_CASE("PeerTable: a new incarnation revives a dead rank once its predecessor's connection is gone, and moves it") {
  asio::io_context io;
  PeerTable table(2);
  auto dial_at = [&](std::string* where) {
    return [&, where](const PeerTable::Address* moved) {
      *where = moved ? moved->host + ":" + std::to_string(moved->port) : "table";
      auto c = table_connection(io, "10.0.0.1", true);
      c->peer_rank = 1;
      return c;
    };
  };
  std::string where;
  auto old_ours = table.outgoing_to(1, "w1", dial_at(&where));
  CHECK(where == "table");
  auto old_theirs = table_connection(io, "10.0.0.1");
  table.add_incoming(old_theirs);
  REQUIRE_FALSE(table.claim(1, old_theirs).has_value());

  auto newcomer = table_connection(io, "10.0.0.2");
  table.add_incoming(newcomer);
  bool admitted = false;
  auto [refusal, old] = table.revive(1, newcomer, {"10.0.0.2", 4242, {}}, [&] { admitted = true; });
  REQUIRE(refusal.has_value());  // the predecessor still speaks for the rank here
  CHECK(refusal->find("still connected") != std::string::npos);
  CHECK_FALSE(admitted);
  CHECK(old == nullptr);

  table.mark_dead(1, "killed");
  CHECK(table.remove(old_theirs).speaks_for_rank);
  auto [refusal2, old2] =
      table.revive(1, newcomer, {"10.0.0.2", 4242, {"host-a", "new-socket"}}, [&] { admitted = true; });
  CHECK_FALSE(refusal2.has_value());
  CHECK(admitted);
  CHECK(old2 == old_ours);  // our connection to the predecessor, for the caller to close
  CHECK(table.is_alive(1));
  CHECK(newcomer->peer_rank == 1);
  auto ours = table.outgoing_to(1, "w1", dial_at(&where));
  CHECK(where == "10.0.0.2:4242");
  CHECK(ours != old_ours);
  std::vector<WorkerInfo> workers(2);
  workers[1].host = "10.0.0.1";
  workers[1].port = 1;
  auto now = table.current_addresses(workers);
  CHECK(now[1].host == "10.0.0.2");
  CHECK(now[1].port == 4242);
  const auto local_now = table.current_local_addresses({{"host-a", "socket0"}, {"host-a", "old-socket"}});
  CHECK((local_now == std::vector<LocalAddress>{{"host-a", "socket0"}, {"host-a", "new-socket"}}));
  table.close();
}

TEST_CASE("PeerTable: a loopback to ourselves does not keep the table open; a connection to a peer does") {
  asio::io_context io;
  PeerTable table(2);
  table.outgoing_to(0, "w0", [&](const PeerTable::Address*) {
    auto c = table_connection(io, "", true);
    c->peer_rank = 0;
    return c;
  });
  CHECK_FALSE(table.any_open(0));
  table.outgoing_to(1, "w1", [&](const PeerTable::Address*) {
    auto c = table_connection(io, "10.0.0.1", true);
    c->peer_rank = 1;
    return c;
  });
  CHECK(table.any_open(0));
}

TEST_CASE("Registrations: a rank or a name registered twice is refused; an admit() refusal records nothing") {
  asio::io_context io;
  Registrations regs;
  regs.add_own(worker("master", 0), "config0", {});
  CHECK(regs.missing(3) == "1, 2");
  auto a = table_connection(io, "10.0.0.1");
  auto b = table_connection(io, "10.0.0.2");
  int admits = 0;
  auto admit = [&] { return ++admits, std::optional<std::string>{}; };
  auto ok = regs.add(worker("w1", 1), a, "config1", {}, admit);
  CHECK_FALSE(ok.rank_taken);
  CHECK_FALSE(ok.not_admitted);
  CHECK_FALSE(ok.duplicate_name);
  CHECK(admits == 1);

  auto same_rank = regs.add(worker("other", 1), b, "", {}, admit);
  REQUIRE(same_rank.rank_taken);
  CHECK(*same_rank.rank_taken == "rank 1 already registered by 'w1'");
  CHECK(admits == 1);

  auto same_name = regs.add(worker("w1", 2), b, "", {}, admit);
  REQUIRE(same_name.duplicate_name);
  CHECK(same_name.duplicate_name->find("worker name 'w1' is already taken by rank 1 (rank 2 claims it too)") !=
        std::string::npos);
  CHECK(same_name.others == std::vector<std::shared_ptr<Connection>>{a});  // rank 0 itself has no connection
  CHECK(admits == 1);

  auto not_admitted = regs.add(worker("w2", 2), b, "", {}, [] { return std::optional<std::string>("spoken for"); });
  REQUIRE(not_admitted.not_admitted);
  CHECK(*not_admitted.not_admitted == "spoken for");
  CHECK(regs.missing(3) == "2");
  CHECK_FALSE(regs.take_if_complete(3).has_value());
}

TEST_CASE("Registrations: the table goes out once, complete and in rank order; a registrant that left is forgotten") {
  asio::io_context io;
  Registrations regs;
  regs.add_own(worker("master", 0), "config0", {"host-a", "socket0"});
  auto c2 = table_connection(io, "10.0.0.2");
  auto c1 = table_connection(io, "10.0.0.1");
  auto none = [] { return std::optional<std::string>{}; };
  regs.add(worker("w2", 2), c2, "config2", {"host-b", "stale"}, none);
  regs.forget(c2);
  CHECK(regs.missing(3) == "1, 2");
  regs.add(worker("w2", 2), c2, "config2", {"host-b", "socket2"}, none);
  regs.add(worker("w1", 1), c1, "config1", {}, none);
  auto world = regs.take_if_complete(3);
  REQUIRE(world.has_value());
  REQUIRE(world->workers.size() == 3);
  for (int r = 0; r < 3; ++r) CHECK(world->workers[r].rank == r);
  CHECK(world->device_configs == std::vector<std::string>{"config0", "config1", "config2"});
  CHECK((world->local == std::vector<LocalAddress>{{"host-a", "socket0"}, {}, {"host-b", "socket2"}}));
  CHECK(world->registrants == std::vector<std::shared_ptr<Connection>>{c1, c2});
  CHECK_FALSE(regs.take_if_complete(3).has_value());  // once
}

TEST_CASE("Registrations: two registrations completing at once publish the table once") {
  for (int round = 0; round < 50; ++round) {
    asio::io_context io;
    Registrations regs;
    regs.add_own(worker("master", 0), "", {});
    auto none = [] { return std::optional<std::string>{}; };
    std::atomic<int> published{0};
    auto registrant = [&](int rank) {
      regs.add(worker("w" + std::to_string(rank), rank), table_connection(io, "10.0.0.1"), "", {}, none);
      if (regs.take_if_complete(3)) published++;
    };
    std::thread t1(registrant, 1), t2(registrant, 2);
    t1.join();
    t2.join();
    CHECK(published.load() == 1);
  }
}

TEST_CASE("WorldGate: requests before the table are parked and handed back in order; after it none is parked") {
  asio::io_context io;
  WorldGate gate;
  auto conn = table_connection(io, "10.0.0.1");
  CHECK(gate.first_table());
  CHECK_FALSE(gate.first_table());
  CHECK_FALSE(gate.known());
  for (int i = 0; i < 3; ++i) {
    Message m;
    m.body = "request " + std::to_string(i);
    CHECK(gate.park_if_unknown(conn, m));
  }
  auto parked = gate.open();
  CHECK(gate.known());
  REQUIRE(parked.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(parked[i].second.body == "request " + std::to_string(i));
  Message late;
  late.body = "late";
  CHECK_FALSE(gate.park_if_unknown(conn, late));
  CHECK(late.body == "late");  // untouched: the caller delivers it
  CHECK(gate.open().empty());
}

TEST_CASE("WorldGate: a request racing the table is either parked and handed back, or delivered, never lost") {
  for (int round = 0; round < 20; ++round) {
    asio::io_context io;
    WorldGate gate;
    auto conn = table_connection(io, "10.0.0.1");
    constexpr int kRequests = 2000;
    std::atomic<int> delivered_directly{0};
    std::thread sender([&] {
      for (int i = 0; i < kRequests; ++i) {
        Message m;
        m.body = std::to_string(i);
        if (!gate.park_if_unknown(conn, m)) delivered_directly++;
      }
    });
    std::this_thread::yield();
    auto parked = gate.open();
    sender.join();
    CHECK(static_cast<int>(parked.size()) + delivered_directly.load() == kRequests);
    for (std::size_t i = 0; i < parked.size(); ++i) CHECK(parked[i].second.body == std::to_string(i));
  }
}

}  // namespace test_call_tables
