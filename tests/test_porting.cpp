// What porting PyTorch's RPC tutorials line by line needs: parameter types without a default constructor, a
// RemoteModule built from options and shared with other workers, timeouts on proxies, literal strings and torch's
// small value types as arguments, and an object that hands out references to itself.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <torch/nn/modules/embedding.h>

#include "corpc/rref/remote_module.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;

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
// required fields, then sets the rest (the mode is a c10::variant of torch's tags, max_norm a c10::optional).
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

namespace {

double scaled(Weight w, double x) { return w.value * x; }

struct Scale {
  explicit Scale(Weight w) : factor(w.value) {}
  double factor;
  double apply(Weight extra, double x) const { return factor * extra.value * x; }
  Weight combined(const Weight& extra) const { return Weight(factor * extra.value); }
};

// Every worker ends a scenario holding nothing: no owned values, no user references, no pending forks.
void expect_no_references(int world) {
  auto deadline = std::chrono::steady_clock::now() + 20s;
  for (;;) {
    bool clean = true;
    std::string report;
    for (int r = 0; r < world; ++r) {
      auto s = rref_stats(r).wait(10s);
      clean = clean && s.owned_values == 0 && s.user_references == 0 && s.pending_forks == 0;
      report += " [" + std::to_string(r) + ": owned " + std::to_string(s.owned_values) + ", users " +
                std::to_string(s.user_references) + ", pending " + std::to_string(s.pending_forks) + "]";
    }
    if (clean) return;
    if (std::chrono::steady_clock::now() > deadline) throw std::runtime_error("references leaked:" + report);
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
      EXPECT(!at::allclose(expected, torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(10, 3)
                                                                 ._weight(local->weight.detach()))
                                          ->forward(input, offsets)));
    }
    expect_no_references(2);
  });
}
