// The calls a connection has in flight (PendingCalls), in process, on the real table (no workers, no mocks): ids with
// generations, so that a late or stray reply finds nothing; deadlines and their order; the per-peer limit and the
// calls that wait for room; callers that block for room; the close that hands every call back.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <future>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../src/rpc/pending_calls.hpp"
#include "support.hpp"  // last: puts doctest's CHECK back over glog's (torch headers above)

namespace test_pending_calls {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::detail;
using namespace std::chrono_literals;

namespace {

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

}  // namespace test_pending_calls
