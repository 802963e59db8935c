// What porting PyTorch's RPC tutorials line by line needs: parameter types without a default constructor, a
// RemoteModule built from options and shared with other workers, timeouts on proxies, literal strings and torch's
// small value types as arguments, and an object that hands out references to itself.
#include <doctest/doctest.h>
#include <torch/nn/modules/embedding.h>

#include "corpc/rref/remote_module.hpp"

#include "leak_checks.hpp"
#include "support.hpp"

// ---- a parameter type without a default constructor ------------------------------------------------------------------
namespace {
struct Weight {
  explicit Weight(double v) : value(v) {}
  double value;
};
}  // namespace

template <>
struct corpc::Codec<Weight> {
  static void write(Writer& w, const Weight& x) { w.put(x.value); }
  static Weight read(Reader& r) { return Weight(r.get<double>()); }
};

// The options of torch::nn::EmbeddingBag have no default constructor either: its Codec builds them from the two
// required fields, then sets the rest (the mode is a variant of torch's tags, max_norm an optional: c10's in libtorch 1.13, std's from 2.x).
template <>
struct corpc::Codec<torch::nn::EmbeddingBagOptions> {
  using O = torch::nn::EmbeddingBagOptions;
  static void write(Writer& w, const O& o) {
    w.put(o.num_embeddings());
    w.put(o.embedding_dim());
    w.put(o.max_norm());
    w.put(o.norm_type());
    w.put(o.scale_grad_by_freq());
    w.put(o.mode());
    w.put(o.sparse());
    w.put(o._weight());
    w.put(o.include_last_offset());
    w.put(o.padding_idx());
  }
  static O read(Reader& r) {
    const auto num = r.get<std::int64_t>();
    O o(num, r.get<std::int64_t>());
    o.max_norm(r.get<c10::optional<double>>());
    o.norm_type(r.get<double>());
    o.scale_grad_by_freq(r.get<bool>());
    o.mode(r.get<torch::nn::EmbeddingBagMode>());
    o.sparse(r.get<bool>());
    o._weight(r.get<at::Tensor>());
    o.include_last_offset(r.get<bool>());
    o.padding_idx(r.get<c10::optional<std::int64_t>>());
    return o;
  }
};

namespace test_porting {  // this file's names, apart from the files it shares an executable with
using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

namespace {

// The variant that torch's options hold: c10's own up to libtorch 2.0, std's after (corpc/detail/torch_compat.hpp).
#if CORPC_C10_HAS_OWN_VARIANT
using IntOrDouble = c10::variant<int, double>;
#else
using IntOrDouble = std::variant<int, double>;
#endif

double scaled(Weight w, double x) { return w.value * x; }

struct Scale {
  explicit Scale(Weight w) : factor(w.value) {}
  double factor;
  double apply(Weight extra, double x) const { return factor * extra.value * x; }
  Weight combined(const Weight& extra) const { return Weight(factor * extra.value); }
};

// An object and a module that take their time: calls on them time out.
struct Sleeper {
  int nap(int ms) const {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return ms;
  }
};
struct SlowIdentityImpl : torch::nn::Module {
  at::Tensor forward(at::Tensor x, std::int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return x;
  }
};
TORCH_MODULE(SlowIdentity);

// Registered by name, as a program built from other sources would call it.
std::string greet(std::string greeting, std::string name, int times) {
  std::string out;
  for (int i = 0; i < times; ++i) out += greeting + ", " + name + "! ";
  return out;
}
// torch's small value types as arguments, the way a one-line wrapper of a torch function takes them.
at::Tensor full_on(std::vector<std::int64_t> size, c10::Scalar fill, at::ScalarType dtype, c10::Device device) {
  return at::full(size, fill, at::TensorOptions().dtype(dtype).device(device));
}

template <class T>
T roundtrip(const T& v) {
  std::string bytes;
  Writer w(bytes);
  w.put(v);
  Reader r(bytes.data(), bytes.size());
  T out = r.get<T>();
  EXPECT_EQ(r.remaining(), 0u);
  return out;
}

template <class T, class... V>
void expect_rejected(const V&... v) {
  std::string bytes;
  Writer w(bytes);
  (w.put(v), ...);
  Reader r(bytes.data(), bytes.size());
  DOCTEST_CHECK_THROWS_AS(r.get<T>(), ProtocolError);  // DOCTEST_: glog (through torch) defines CHECK
}

// The RL tutorial's shape: an agent hands observers a reference to itself, and they report back through it.
struct Agent;
Task<int> observe(RRef<Agent> agent, int reward);
struct Agent : EnableRRefFromThis<Agent> {
  std::atomic<int> total{0};
  int report(int reward) { return total += reward; }
  Task<int> run(int episodes) {
    std::vector<Future<int>> steps;
    for (int i = 1; i <= episodes; ++i)
      steps.push_back(rpc_async<&observe>(i % 2 ? "worker2" : "worker1", rref_from_this(), i));
    co_await when_all(std::move(steps));
    co_return total.load();
  }
};

Task<int> observe(RRef<Agent> agent, int reward) { co_return co_await agent.rpc_async<&Agent::report>(reward); }

using Bag = RemoteModule<torch::nn::EmbeddingBag>;

// A trainer's use of a module it was handed: forward, and its parameters through the awaitable form.
Task<at::Tensor> use_module(Bag bag, at::Tensor input, at::Tensor offsets) {
  std::vector<RRef<at::Tensor>> params = co_await bag.remote_parameters_async();
  EXPECT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].owner_name(), "worker1");
  co_return co_await bag.forward_async(input, offsets);
}

std::optional<Bag> g_kept_module;  // a trainer that keeps the module past the call that brought it
void keep_module(Bag bag) { g_kept_module = std::move(bag); }
at::Tensor use_kept_module(at::Tensor input, at::Tensor offsets) { return g_kept_module->forward(input, offsets); }
void drop_kept_module() { g_kept_module.reset(); }

// Waits until `worker` owns exactly `n` values (deletes travel asynchronously).
void wait_until_owned(const WorkerRef& worker, std::uint64_t n) {
  auto deadline = std::chrono::steady_clock::now() + 20s;
  std::uint64_t owned = 0;
  while ((owned = rref_stats(worker).wait(10s).owned_values) != n) {
    if (std::chrono::steady_clock::now() > deadline)
      throw std::runtime_error("expected " + std::to_string(n) + " owned values, have " + std::to_string(owned));
    std::this_thread::sleep_for(10ms);
  }
}

}  // namespace

TEST_CASE("parameter types without a default constructor go through remote() and every proxy") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      RRef<double> six = remote<&scaled>("worker1", Weight(2), 3.0);
      EXPECT_EQ(six.to_here().wait(10s), 6.0);

      RRef<Scale> scale = remote<Scale>("worker1", Weight(2));
      EXPECT_EQ(scale.rpc_async<&Scale::apply>(Weight(3), 1.0).wait(10s), 6.0);
      EXPECT_EQ(scale.rpc_sync<&Scale::apply>(Weight(5), 1.0), 10.0);
      RRef<double> kept = scale.remote<&Scale::apply>(Weight(4), 1.0);
      EXPECT_EQ(kept.to_here().wait(10s), 8.0);
      EXPECT_EQ(scale.rpc_async<&Scale::combined>(Weight(7)).wait(10s).value, 14.0);  // and as a result
    }
    expect_no_references(2);
  });
}

TEST_CASE("RemoteModule<EmbeddingBag> built from options without a default constructor equals the local module") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      const auto options = torch::nn::EmbeddingBagOptions(10, 3).mode(torch::kSum);
      RemoteModule<torch::nn::EmbeddingBag> remote_bag("worker1/cpu", options);
      auto params = remote_bag.remote_parameters();
      EXPECT_EQ(params.size(), 1u);
      torch::nn::EmbeddingBag local(options);
      {
        torch::NoGradGuard no_grad;
        local->weight.copy_(params[0].to_here().wait(10s));
      }
      const auto input = torch::tensor({1, 2, 4, 5, 4, 3, 2, 9}, torch::kLong);
      const auto offsets = torch::tensor({0, 4}, torch::kLong);
      const at::Tensor expected = local->forward(input, offsets);
      EXPECT(at::equal(remote_bag.forward(input, offsets), expected));
      // kSum really arrived: the default (kMean) would give a quarter of it.
      EXPECT(!at::allclose(
          expected, torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(10, 3)._weight(local->weight.detach()))
                        ->forward(input, offsets)));
    }
    expect_no_references(2);
  });
}

TEST_CASE("a RemoteModule passed to two workers is shared by both, and freed when the last of them lets go") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    const auto input = torch::tensor({1, 2, 4, 5, 4, 3, 2, 9}, torch::kLong);
    const auto offsets = torch::tensor({0, 4}, torch::kLong);
    {
      Bag bag("worker1/cpu", torch::nn::EmbeddingBagOptions(10, 3).mode(torch::kSum));
      const at::Tensor expected = bag.forward(input, offsets);
      // To its owner and to a third worker; both run the same module (a copy would have other random weights).
      EXPECT(at::equal(rpc_sync<&use_module>("worker1", bag, input, offsets), expected));
      EXPECT(at::equal(rpc_sync<&use_module>("worker2", bag, input, offsets), expected));
      rpc_sync<&keep_module>("worker2", bag);
    }
    // The master's reference is gone (once its delete has arrived, worker1 owns only the module): worker2's keeps
    // the module alive.
    wait_until_owned("worker1", 1);
    EXPECT_EQ(rpc_sync<&use_kept_module>("worker2", input, offsets).size(0), 2);
    rpc_sync<&drop_kept_module>("worker2");
    expect_no_references(3);
  });
}

TEST_CASE("proxy calls and RemoteModule::forward take a timeout, and time out with TimeoutError") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    {
      auto sleeper = remote<Sleeper>("worker1", with_timeout(10s));
      EXPECT_THROWS_AS(sleeper.rpc_async<&Sleeper::nap>(with_timeout(50ms), 1000).wait(20s), TimeoutError);
      EXPECT_THROWS_AS(sleeper.rpc_sync<&Sleeper::nap>(with_timeout(50ms), 1000), TimeoutError);
      EXPECT_EQ(sleeper.rpc_async<&Sleeper::nap>(with_timeout(10s), 1).wait(20s), 1);  // the same call, in time
      EXPECT_EQ(sleeper.remote<&Sleeper::nap>(with_timeout(10s), 2).to_here().wait(20s), 2);

      RemoteModule<SlowIdentity> slow("worker1/cpu", with_timeout(10s));  // the creation takes options too
      const auto x = at::ones({2});
      EXPECT_THROWS_AS(slow.forward_async(with_timeout(50ms), x, std::int64_t{1000}).wait(20s), TimeoutError);
      EXPECT_THROWS_AS(slow.forward(with_timeout(50ms), x, std::int64_t{1000}), TimeoutError);
      EXPECT(at::equal(slow.forward(with_timeout(10s), x, std::int64_t{0}), x));
      EXPECT_EQ(slow.remote_parameters(with_timeout(10s)).size(), 0u);
    }
    expect_no_references(2);
  });
}

TEST_CASE("torch's value types round-trip, and a malformed one is a ProtocolError") {
  DOCTEST_CHECK((roundtrip(c10::Scalar(2.5)).toDouble() == 2.5));
  DOCTEST_CHECK((roundtrip(c10::Scalar(std::int64_t{1} << 40)).toLong() == std::int64_t{1} << 40));
  DOCTEST_CHECK((roundtrip(c10::Scalar(true)).isBoolean()));
  DOCTEST_CHECK((roundtrip(c10::Scalar(c10::complex<double>(1, -2))).toComplexDouble() == c10::complex<double>(1, -2)));
  DOCTEST_CHECK((roundtrip(c10::Scalar(3)).isIntegral(false)));
  DOCTEST_CHECK((roundtrip(c10::Device("cpu")) == c10::Device("cpu")));
  DOCTEST_CHECK((roundtrip(c10::Device("cuda:1")) == c10::Device("cuda:1")));
  DOCTEST_CHECK((roundtrip(at::kBFloat16) == at::kBFloat16));
  DOCTEST_CHECK((roundtrip(c10::optional<double>()) == c10::nullopt));
  DOCTEST_CHECK((roundtrip(c10::optional<double>(1.5)) == 1.5));
  DOCTEST_CHECK((roundtrip(torch::nn::EmbeddingBagMode(torch::kMax)).index() == 2));
  DOCTEST_CHECK((roundtrip(torch::nn::EmbeddingBagMode(torch::kSum)).index() == 0));
  const auto opts = roundtrip(torch::nn::EmbeddingBagOptions(7, 2).mode(torch::kSum).max_norm(0.5).padding_idx(3));
  DOCTEST_CHECK((opts.num_embeddings() == 7));
  DOCTEST_CHECK((opts.mode().index() == 0));  // torch::kSum
  DOCTEST_CHECK((opts.max_norm() == 0.5));
  DOCTEST_CHECK((opts.padding_idx() == 3));

  expect_rejected<c10::Scalar>(std::uint8_t{9}, 1.0);  // unknown kind
  expect_rejected<c10::Scalar>(std::uint8_t{2}, 1.0);  // complex, truncated
  expect_rejected<c10::ScalarType>(std::int8_t{-1});
  expect_rejected<c10::ScalarType>(static_cast<std::int8_t>(at::ScalarType::NumOptions));
  expect_rejected<c10::Device>(std::int8_t{100}, std::int8_t{0});  // unknown device type
  expect_rejected<c10::Device>(std::int8_t{0}, std::int8_t{3});    // cpu:3
  expect_rejected<c10::Device>(std::int8_t{1}, std::int8_t{-5});
  expect_rejected<c10::Device>(std::int8_t{1});  // truncated
  expect_rejected<c10::optional<int>>(std::uint8_t{5});
  expect_rejected<torch::nn::EmbeddingBagMode>(std::uint32_t{3});
  expect_rejected<IntOrDouble>(std::uint32_t{1}, std::int32_t{1});  // a double cut short
}

TEST_CASE("by-name calls take string literals and torch's value types") {
  register_function<&greet>("greet");
  register_function<&full_on>("full_on");
  run_world(2, [](int rank) {
    if (rank != 0) return;
    EXPECT_EQ(rpc_async<std::string>("worker1", "greet", "hi", "corpc", 2).wait(10s), "hi, corpc! hi, corpc! ");
    const char* name = "you";
    EXPECT_EQ(rpc_async<std::string>("worker1", "greet", with_timeout(10s), std::string("yo"), name, 1).wait(20s),
              "yo, you! ");
    const at::Tensor t = rpc_async<at::Tensor>("worker1", "full_on", std::vector<std::int64_t>{2, 3}, c10::Scalar(7),
                                               at::kInt, c10::Device("cpu"))
                             .wait(10s);
    EXPECT(at::equal(t, at::full({2, 3}, 7, at::kInt)));
    EXPECT(rpc_sync<&full_on>("worker1", std::vector<std::int64_t>{1}, 2.5, at::kDouble, c10::kCPU).item<double>() ==
           2.5);
  });
}

TEST_CASE("an object hands out references to itself, and is freed when the last reference elsewhere goes") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    {
      RRef<Agent> agent = remote<Agent>("worker1");
      EXPECT_EQ(agent.rpc_sync<&Agent::run>(4), 1 + 2 + 3 + 4);  // observers on its owner and on another worker
      EXPECT_EQ(agent.rpc_sync<&Agent::run>(2), 10 + 1 + 2);
      Agent unowned;
      EXPECT_THROWS_AS(unowned.rref_from_this(), UsageError);
    }
    expect_no_references(3);  // the agent is gone: it never held a reference to itself
  });
}

}  // namespace test_porting
