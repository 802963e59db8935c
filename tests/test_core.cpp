// Coroutine primitives and the codec, in one process, without torch.
#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <numeric>
#include <thread>

#include "corpc/core/scope.hpp"
#include "corpc/core/sync_wait.hpp"
#include "corpc/core/task.hpp"
#include "corpc/core/this_call.hpp"
#include "corpc/core/type_name.hpp"
#include "corpc/core/when_all.hpp"
#include "corpc/wire/codec.hpp"

using namespace corpc;
using namespace std::chrono_literals;

namespace {

Task<int> forty_two() { co_return 42; }
Task<int> add_one(Task<int> t) { co_return (co_await std::move(t)) + 1; }
Task<void> throws() {
  throw std::logic_error("boom");
  co_return;
}

Future<int> later(int v, std::chrono::milliseconds delay) {
  Promise<int> p;
  auto f = p.get_future();
  std::thread([p = std::move(p), v, delay]() mutable {
    std::this_thread::sleep_for(delay);
    p.set_value(v);
  }).detach();
  return f;
}

template <class T>
T roundtrip(const T& v) {
  std::string bytes;
  Writer w(bytes);
  w.put(v);
  Reader r(bytes.data(), bytes.size());
  T out = r.get<T>();
  CHECK(r.remaining() == 0);
  return out;
}

struct Point {
  double x = 0, y = 0;
  std::string label;
  bool operator==(const Point&) const = default;
  CORPC_FIELDS(x, y, label)
};

}  // namespace

Task<int> mark_started(std::atomic<bool>* started) {
  *started = true;
  co_return 1;
}

int free_function(int) { return 0; }
struct Widget {
  int method(double) const { return 0; }
};

TEST_CASE("function and type names are what the wire keys are made of") {
  CHECK(function_name<&free_function>() == "free_function");
  CHECK(function_name<&Widget::method>() == "Widget::method");
  CHECK(type_name<std::tuple<int, double>>() == "std::tuple<int, double>");
  static_assert(function_name<&free_function>() == "free_function");
}

TEST_CASE("a Task is lazy and delivers its value or its exception") {
  std::atomic<bool> started{false};
  auto t = mark_started(&started);
  CHECK_FALSE(started.load());
  CHECK(sync_wait(std::move(t)) == 1);
  CHECK(started.load());
  CHECK(sync_wait(add_one(add_one(forty_two()))) == 44);
  CHECK_THROWS_AS(sync_wait(throws()), std::logic_error);
}

TEST_CASE("a Future completes once, from any thread, and wakes every kind of waiter") {
  Promise<int> p;
  auto f = p.get_future();
  CHECK_FALSE(f.done());
  CHECK_THROWS_AS(f.value(), UsageError);
  CHECK_THROWS_AS(f.wait(10ms), TimeoutError);
  CHECK(p.set_value(7));
  CHECK_FALSE(p.set_value(8));  // first completion wins
  CHECK(f.wait() == 7);
  CHECK(f.value() == 7);
  auto copy = f;
  CHECK(copy.wait(1ms) == 7);
  CHECK(later(5, 20ms).wait(5s) == 5);
}

TEST_CASE("a destroyed promise breaks its future instead of leaving it hanging") {
  Future<int> f;
  {
    Promise<int> p;
    f = p.get_future();
  }
  CHECK(f.done());
  CHECK_THROWS_AS(f.wait(), RpcError);
}

TEST_CASE("then chains values and skips its function on error") {
  auto f = later(2, 5ms).then([](int v) { return v * 10; }).then([](int v) { return std::to_string(v); });
  CHECK(f.wait(5s) == "20");
  bool called = false;
  auto g = make_exceptional_future<int>(std::make_exception_ptr(std::runtime_error("x"))).then([&](int) {
    called = true;
    return 0;
  });
  CHECK_THROWS_AS(g.wait(), std::runtime_error);
  CHECK_FALSE(called);
  auto h = make_ready_future(1).then([](int) -> int { throw std::out_of_range("cb"); });
  CHECK_THROWS_AS(h.wait(), std::out_of_range);
}

TEST_CASE("co_await resumes on the executor the coroutine suspended on") {
  ThreadPool pool(2);
  auto task = [&]() -> Task<bool> {
    // Running on the pool: after awaiting a future completed by a foreign thread, we are back on the pool.
    co_await later(1, 10ms);
    co_return current_executor() == &pool;
  };
  CHECK(spawn(pool, task()).wait(5s));
  // sync_wait brings continuations back to the calling thread.
  auto main_id = std::this_thread::get_id();
  auto same_thread = sync_wait([&]() -> Task<bool> {
    co_await later(1, 10ms);
    co_return std::this_thread::get_id() == main_id;
  }());
  CHECK(same_thread);
}

TEST_CASE("the call context follows a coroutine across threads") {
  ThreadPool pool(2);
  static const int slot = CallContext::new_slot();
  auto task = []() -> Task<std::int64_t> {
    CallContext ctx;
    ctx.set(slot, 17);
    CallContextScope scope(ctx);
    co_await later(1, 5ms);  // completes on a foreign thread, resumes on a pool thread
    co_await later(1, 5ms);
    co_return current_call_context().get(slot);
  };
  CHECK(spawn(pool, task()).wait(5s) == 17);
  CHECK(current_call_context().get(slot) == CallContext::kUnset);
}

TEST_CASE("when_all gathers in order and fails with the first error; collect_all never fails") {
  std::vector<Future<int>> fs;
  for (int i = 0; i < 5; ++i) fs.push_back(later(i, std::chrono::milliseconds(25 - 5 * i)));
  auto all = sync_wait([&]() -> Task<std::vector<int>> { co_return co_await when_all(fs); }());
  CHECK(all == std::vector<int>{0, 1, 2, 3, 4});
  CHECK(when_all(std::vector<Future<int>>{}).wait().empty());

  Promise<int> never;
  std::vector<Future<int>> mixed{
      later(1, 1ms), make_exceptional_future<int>(std::make_exception_ptr(TimeoutError("t"))), never.get_future()};
  // Fails at once with the error, without waiting for the future that never completes.
  CHECK_THROWS_AS(when_all(mixed).wait(5s), TimeoutError);

  std::vector<Future<int>> two{later(3, 5ms),
                               make_exceptional_future<int>(std::make_exception_ptr(std::runtime_error("e")))};
  auto collected = collect_all(two).wait(5s);
  REQUIRE(collected.size() == 2);
  CHECK(collected[0].value() == 3);
  CHECK(collected[1].has_error());

  std::vector<Future<void>> voids{make_ready_future(), make_ready_future()};
  when_all(voids).wait();
}

// The names before when_all stay for one release; a program that still uses them gets a deprecation warning only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
TEST_CASE("the deprecated wait_all and WaitAll still join") {
  CHECK(wait_all(std::vector<Future<int>>{later(1, 1ms), later(2, 1ms)}).wait(5s) == std::vector<int>{1, 2});
  Promise<int> running;
  auto all =
      wait_all(std::vector<Future<int>>{running.get_future(),
                                        make_exceptional_future<int>(std::make_exception_ptr(TimeoutError("t")))},
               WaitAll::stop_rest_on_failure);
  CHECK_THROWS_AS(all.wait(5s), TimeoutError);
}
#pragma GCC diagnostic pop

TEST_CASE("set_exception takes an exception_ptr or an exception object") {
  Promise<int> by_ptr, by_object;
  CHECK(by_ptr.set_exception(std::make_exception_ptr(TimeoutError("t"))));
  CHECK(by_object.set_exception(TimeoutError("t")));
  CHECK(!by_object.set_exception(UsageError("late")));  // the first completion wins
  CHECK_THROWS_AS(by_ptr.get_future().wait(), TimeoutError);
  CHECK_THROWS_AS(by_object.get_future().wait(), TimeoutError);
}

TEST_CASE("thousands of continuations on a pool complete exactly once") {
  ThreadPool pool(4);
  std::atomic<int> sum{0};
  std::vector<Future<void>> fs;
  for (int i = 0; i < 5000; ++i) {
    // Captureless: a coroutine lambda's captures die with the temporary closure, before the pool runs the task.
    fs.push_back(spawn(pool, [](std::atomic<int>& total, int v) -> Task<void> {
      co_await make_ready_future(0);
      total += v;
    }(sum, i)));
  }
  when_all(fs).wait(10s);
  CHECK(sum.load() == 5000 * 4999 / 2);
}

TEST_CASE("the codec round-trips the supported types") {
  CHECK(roundtrip(std::int64_t{-5}) == -5);
  CHECK(roundtrip(3.5f) == 3.5f);
  CHECK(roundtrip(true));
  CHECK(roundtrip(std::string("héllo")) == "héllo");
  CHECK(roundtrip(std::vector<int>{1, 2, 3}) == std::vector<int>{1, 2, 3});
  CHECK(roundtrip(std::vector<std::string>{"a", "", "c"}) == std::vector<std::string>{"a", "", "c"});
  CHECK(roundtrip(std::optional<int>{}) == std::nullopt);
  CHECK(roundtrip(std::optional<int>{4}) == 4);
  CHECK(roundtrip(std::make_pair(1, std::string("x"))) == std::make_pair(1, std::string("x")));
  CHECK(roundtrip(std::make_tuple(1, 2.0, std::string("z"))) == std::make_tuple(1, 2.0, std::string("z")));
  CHECK(roundtrip(std::map<std::string, int>{{"a", 1}, {"b", 2}}) == std::map<std::string, int>{{"a", 1}, {"b", 2}});
  CHECK(roundtrip(std::array<int, 3>{1, 2, 3}) == std::array<int, 3>{1, 2, 3});
  CHECK(roundtrip(Point{1, 2, "p"}) == Point{1, 2, "p"});
}

TEST_CASE("the codec rejects lengths the payload cannot hold, before allocating") {
  std::string bytes;
  Writer w(bytes);
  w.put(std::uint32_t{0xfffffff0u});  // claims four billion elements
  w.put(std::int32_t{1});
  Reader r1(bytes.data(), bytes.size());
  CHECK_THROWS_AS(r1.get<std::vector<std::int64_t>>(), ProtocolError);
  Reader r2(bytes.data(), bytes.size());
  CHECK_THROWS_AS(r2.get<std::string>(), ProtocolError);
  Reader r3(bytes.data(), bytes.size());
  CHECK_THROWS_AS(r3.get<std::vector<std::string>>(), ProtocolError);
  Reader r4(bytes.data(), 2);
  CHECK_THROWS_AS(r4.get<std::uint32_t>(), ProtocolError);
  std::string badbool("\x07", 1);
  Reader r5(badbool.data(), badbool.size());
  CHECK_THROWS_AS(r5.get<bool>(), ProtocolError);
}

// Found by tests/fuzz/fuzz_codec.cpp (input kept in its corpus as regression_vector_of_monostate): five bytes asked
// for 0xff000005 elements that encode to nothing, and the decoder built them all (4 GiB, minutes of CPU).
TEST_CASE("the codec bounds elements that encode to nothing") {
  std::string bytes("\x05\x00\x00\xff", 4);
  Reader r1(bytes.data(), bytes.size());
  CHECK_THROWS_AS(r1.get<std::vector<std::monostate>>(), ProtocolError);
  // Nested, the budget is per payload, not per container.
  std::string nested;
  Writer w(nested);
  w.put(std::uint32_t{64});
  for (int i = 0; i < 64; ++i) w.put(std::uint32_t{Reader::kMaxEmptyElements / 32});
  Reader r2(nested.data(), nested.size());
  CHECK_THROWS_AS(r2.get<std::vector<std::vector<std::monostate>>>(), ProtocolError);
  // What a real sender writes still decodes.
  CHECK(roundtrip(std::vector<std::monostate>(1000)).size() == 1000);
}

namespace {
enum class Color : std::uint8_t { red, green, blue };
struct Celsius {  // no default constructor
  explicit Celsius(double d) : degrees(d) {}
  double degrees;
  bool operator==(const Celsius&) const = default;
};
}  // namespace

template <>
struct corpc::Codec<Celsius> {
  static void write(Writer& w, const Celsius& c) { w.put(c.degrees); }
  static Celsius read(Reader& r) { return Celsius(r.get<double>()); }
};

TEST_CASE("the codec round-trips variants, maps, enums, and arrays of types without a default constructor") {
  using V = std::variant<int, std::string, int, std::monostate>;  // a repeated alternative keeps its index
  CHECK(roundtrip(V(std::in_place_index<0>, 4)).index() == 0);
  CHECK(roundtrip(V(std::in_place_index<2>, 4)).index() == 2);
  CHECK(std::get<1>(roundtrip(V(std::string("s")))) == "s");
  CHECK(roundtrip(V(std::monostate{})).index() == 3);
  CHECK(roundtrip(std::unordered_map<int, std::string>{{1, "a"}, {2, ""}}) ==
        std::unordered_map<int, std::string>{{1, "a"}, {2, ""}});
  CHECK(roundtrip(std::map<int, std::vector<int>>{{1, {2, 3}}}) == std::map<int, std::vector<int>>{{1, {2, 3}}});
  CHECK(roundtrip(Color::blue) == Color::blue);
  CHECK(roundtrip(std::array<Celsius, 2>{Celsius(1), Celsius(-2)}) == std::array<Celsius, 2>{Celsius(1), Celsius(-2)});
  CHECK(roundtrip(std::optional<Celsius>(Celsius(3))) == Celsius(3));
}

TEST_CASE("the codec rejects variant tags, counts and truncations the payload cannot back") {
  auto bytes_of = [](auto... v) {
    std::string b;
    Writer w(b);
    (w.put(v), ...);
    return b;
  };
  auto read_as = [](const std::string& b, auto type) {
    Reader r(b.data(), b.size());
    return r.get<typename decltype(type)::type>();
  };
  using V = std::variant<int, std::string>;
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{2}, 1), std::type_identity<V>{}), ProtocolError);  // no alternative 2
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{0xffffffffu}), std::type_identity<V>{}), ProtocolError);
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{1}, std::uint32_t{1000}), std::type_identity<V>{}), ProtocolError);
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{0}), std::type_identity<V>{}), ProtocolError);  // truncated int
  using M = std::unordered_map<int, int>;
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{0xfffffff0u}, 1, 2), std::type_identity<M>{}), ProtocolError);
  CHECK_THROWS_AS(read_as(bytes_of(std::uint32_t{2}, 1, 2), std::type_identity<M>{}), ProtocolError);
  CHECK_THROWS_AS(read_as(bytes_of(1.0), std::type_identity<std::array<Celsius, 2>>{}), ProtocolError);
  CHECK_THROWS_AS(read_as(bytes_of(std::uint8_t{2}), std::type_identity<std::optional<int>>{}), ProtocolError);
}

TEST_CASE("a BoundedExecutor never runs more than its width at once, and starts jobs in order") {
  ThreadPool pool(4);
  for (std::size_t width : {1u, 2u}) {
    BoundedExecutor bounded(pool, width);
    std::atomic<int> running{0}, peak{0};
    std::mutex order_mutex;
    std::vector<int> order;
    std::vector<Future<void>> done;
    for (int i = 0; i < 40; ++i) {
      Promise<void> p;
      done.push_back(p.get_future());
      bounded.post([&, i, p = std::make_shared<Promise<void>>(std::move(p))] {
        {
          std::lock_guard lock(order_mutex);
          order.push_back(i);
        }
        int now = ++running;
        int seen = peak.load();
        while (now > seen && !peak.compare_exchange_weak(seen, now)) {}
        std::this_thread::sleep_for(1ms);
        --running;
        p->set_value();
      });
    }
    when_all(done).wait(10s);
    CHECK(peak.load() <= static_cast<int>(width));
    if (width == 1) {
      std::vector<int> expected(40);
      std::iota(expected.begin(), expected.end(), 0);
      CHECK(order == expected);
    }
  }
}

TEST_CASE("a BoundedExecutor of width 2 or more hands each queued job to exactly one runner") {
  // Two runners finishing at once while one job is queued must not both go for it: the loser would pop an empty
  // queue. Tiny jobs posted from two threads make such finishes frequent.
  ThreadPool pool(4);
  for (std::size_t width : {2u, 3u}) {
    BoundedExecutor bounded(pool, width);
    constexpr int kPerThread = 20000;
    std::atomic<int> ran{0};
    Promise<void> all_ran;
    auto post_many = [&] {
      for (int i = 0; i < kPerThread; ++i)
        bounded.post([&] {
          if (++ran == 2 * kPerThread) all_ran.set_value();
        });
    };
    std::thread other(post_many);
    post_many();
    other.join();
    CHECK_NOTHROW(all_ran.get_future().wait(30s));
    CHECK(ran.load() == 2 * kPerThread);
  }
}

namespace {
// Parks on a future nobody completes; only a stop ends it. Counts how it ended.
corpc::Task<void> park_in_scope(corpc::Future<void> never, std::atomic<int>* stopped) {
  try {
    co_await never;
  } catch (const corpc::CancelledError&) {
    if (corpc::this_call::stop_requested()) ++*stopped;
    throw;
  }
}
}  // namespace

TEST_CASE("a TaskScope stops its tasks at their next await and joins them; cancel() completes a future as cancelled") {
  corpc::Promise<void> never;
  std::atomic<int> stopped{0};
  corpc::TaskScope scope;
  std::vector<corpc::Future<void>> tasks;
  for (int i = 0; i < 3; ++i) tasks.push_back(scope.spawn(park_in_scope(never.get_future(), &stopped)));
  CHECK(scope.active() == 3);
  CHECK(!corpc::this_call::stop_token().stop_possible());  // the starter's own context is untouched
  auto joined = scope.stop_and_join();
  joined.wait();
  CHECK(stopped == 3);
  CHECK(scope.active() == 0);
  for (auto& t : tasks) CHECK(t.cancelled());
  CHECK_THROWS_AS((void)scope.spawn(park_in_scope(never.get_future(), &stopped)), corpc::UsageError);

  CHECK(!never.get_future().done());  // a stopped await leaves the shared future it awaited alone

  // cancel() completes a future as cancelled; the producer's later value loses. A cancelled when_all asks its
  // inputs' producers to stop, but does not complete inputs that others may share.
  corpc::Promise<int> a, b;
  auto fa = a.get_future();
  fa.cancel();
  CHECK(fa.cancelled());
  CHECK(!a.set_value(1));
  auto all = corpc::when_all(std::vector<corpc::Future<int>>{b.get_future()});
  all.cancel();
  CHECK(all.cancelled());
  CHECK(b.set_value(2));
}
