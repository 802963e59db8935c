// Distributed autograd and DistributedOptimizer against the same computation in one process.
#include <doctest/doctest.h>
#include <torch/autograd.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <mutex>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/autograd/optimizer.hpp"
#include "corpc/rref/remote_module.hpp"

#include "leak_checks.hpp"
#include "support.hpp"

namespace test_dist_autograd {  // this file's names, apart from the files it shares an executable with

using namespace corpc;
using namespace corpc::test;
using namespace std::chrono_literals;
namespace da = corpc::dist_autograd;

namespace {

// Equivalence tolerance: same inputs, same initial weights, same operations; only the order in which gradient
// contributions are summed may differ between one process and several (float reassociation).
bool close(const at::Tensor& a, const at::Tensor& b) { return at::allclose(a, b, /*rtol=*/1e-5, /*atol=*/1e-6); }

torch::nn::Sequential make_stage(std::int64_t in, std::int64_t out, std::uint64_t seed) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  return torch::nn::Sequential(torch::nn::Linear(in, out), torch::nn::Tanh());
}

// This worker's gradient of one of its own parameters in context `ctx`.
at::Tensor grad_of(std::int64_t ctx, RRef<at::Tensor> param) {
  auto grads = da::get_gradients(ctx);
  auto it = grads.find(param.local_value());
  return it == grads.end() ? at::Tensor() : it->second;
}

at::Tensor times_three_sum(at::Tensor t) { return (t * 3).sum(); }

Task<at::Tensor> hop(at::Tensor x, std::vector<std::string> path) {
  auto y = x * 2 + 1;
  if (path.empty()) co_return y.sin();
  auto next = path.front();
  path.erase(path.begin());
  co_return co_await rpc_async<&hop>(next, y, path);
}

at::Tensor make_param(std::int64_t n) {
  torch::manual_seed(3);
  return at::rand({n}).set_requires_grad(true);
}

struct Scaler {
  at::Tensor w = at::full({3}, 1.5).set_requires_grad(true);
  at::Tensor apply(at::Tensor x) { return x * w; }
  RRef<at::Tensor> weight() { return RRef<at::Tensor>(w); }
};

struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("backward exploded");
  }
};
at::Tensor fragile(at::Tensor x) { return ThrowInBackward::apply(x * 2); }

template <class Opt, class Options>
void train_mlp_and_compare(const Options& options) {
  const int steps = 4;
  torch::manual_seed(42);
  auto x = at::rand({6, 8});
  auto y = at::rand({6, 4});
  RemoteModule<torch::nn::Sequential> s1(remote<&make_stage>("worker1", 8, 16, 1));
  RemoteModule<torch::nn::Sequential> s2(remote<&make_stage>("worker2", 16, 4, 2));
  auto params = s1.remote_parameters();
  auto p2 = s2.remote_parameters();
  params.insert(params.end(), p2.begin(), p2.end());
  DistributedOptimizer<Opt> dopt(params, options);

  auto l1 = make_stage(8, 16, 1), l2 = make_stage(16, 4, 2);
  std::vector<at::Tensor> local_params;
  for (auto& p : l1->parameters()) local_params.push_back(p);
  for (auto& p : l2->parameters()) local_params.push_back(p);
  Opt lopt(local_params, options);

  for (int step = 0; step < steps; ++step) {
    da::Context ctx;
    auto h = s1.forward(x);
    auto out = s2.forward(h);
    auto loss = torch::nn::functional::mse_loss(out, y);
    ctx.backward(loss).wait(30s);  // one root

    lopt.zero_grad();
    auto lloss = torch::nn::functional::mse_loss(l2->forward(l1->forward(x)), y);
    lloss.backward();
    EXPECT(close(loss, lloss));
    if (step == 0) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        auto g = rpc_sync<&grad_of>(params[i].owner().rank, ctx.id(), params[i]);
        EXPECT(g.defined());
        EXPECT(close(g, local_params[i].grad()));
      }
    }
    dopt.step(ctx).wait(30s);
    lopt.step();
  }
  for (std::size_t i = 0; i < params.size(); ++i) EXPECT(close(params[i].to_here().wait(10s), local_params[i]));
}

}  // namespace

TEST_CASE("a two-stage MLP across master and two workers trains exactly like one process (SGD and Adam)") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    train_mlp_and_compare<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9));
    train_mlp_and_compare<torch::optim::Adam>(torch::optim::AdamOptions(0.01));
    expect_no_contexts(3);
  });
}

TEST_CASE("a tensor sent twice, and a chain A -> B -> C -> A, get the gradients of one process") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    auto w = at::rand({5}).set_requires_grad(true);
    {
      da::Context ctx;
      auto t = w * 2;
      auto loss = rpc_sync<&times_three_sum>(1, t) + rpc_sync<&times_three_sum>(2, t);
      ctx.backward({loss}).wait(30s);
      auto g = ctx.gradients();
      EXPECT(close(g.at(w), at::full({5}, 12.0)));
      EXPECT(!w.grad().defined());  // never into .grad
      // A second backward in the same context adds up.
      ctx.backward({loss}).wait(30s);
      EXPECT(close(ctx.gradients().at(w), at::full({5}, 24.0)));
    }
    {
      da::Context ctx;
      auto out = rpc_sync<&hop>("worker1", w, std::vector<std::string>{"worker2", "master"});
      auto loss = (out * out).sum();
      ctx.backward({loss}).wait(30s);
      auto ref_w = w.detach().clone().set_requires_grad(true);
      auto ref = (((ref_w * 2 + 1) * 2 + 1) * 2 + 1).sin();  // three hops, then sin
      (ref * ref).sum().backward();
      EXPECT(close(ctx.gradients().at(w), ref_w.grad()));
    }
    expect_no_contexts(3);
  });
}

TEST_CASE("gradients flow through to_here and through RRef proxies to the owners") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    auto p = remote<&make_param>("worker1", 4);
    auto scaler = remote<Scaler>("worker2");
    auto x = at::rand({3}).set_requires_grad(true);
    {
      da::Context ctx;
      auto v = p.to_here().wait(10s);
      auto s = scaler.rpc_sync<&Scaler::apply>(x);
      auto loss = (v * v).sum() + s.sum();
      ctx.backward({loss}).wait(30s);
      auto pv = p.to_here().wait(10s);
      EXPECT(close(rpc_sync<&grad_of>(1, ctx.id(), p), pv.detach() * 2));
      EXPECT(close(ctx.gradients().at(x), at::full({3}, 1.5)));
      EXPECT(close(rpc_sync<&grad_of>(2, ctx.id(), scaler.rpc_sync<&Scaler::weight>()), x.detach()));
    }
    expect_no_contexts(3);
  });
}

namespace {
// Both trainers ask for the weight at once, on two of the master's pool threads: the lazy
// creation is guarded so that they share one parameter (TSan caught the unguarded version).
std::mutex g_ps_mutex;
RRef<at::Tensor> g_ps_weight;
RRef<at::Tensor> ps_weight() {
  std::lock_guard lock(g_ps_mutex);
  if (!g_ps_weight.valid()) g_ps_weight = RRef<at::Tensor>(at::ones({2}).set_requires_grad(true));
  return g_ps_weight;
}
void ps_forget() {
  std::lock_guard lock(g_ps_mutex);
  g_ps_weight = RRef<at::Tensor>();
}

// A trainer: its own context, its own gradient k * ones on the parameter server.
at::Tensor train_once(std::int64_t k) {
  auto w = rpc_sync<&ps_weight>("master");
  da::Context ctx;
  auto v = w.to_here().wait(10s);
  std::this_thread::sleep_for(100ms);  // overlap with the other trainer
  ctx.backward({(v * static_cast<double>(k)).sum()}).wait(30s);
  return rpc_sync<&grad_of>("master", ctx.id(), w);
}
}  // namespace

TEST_CASE("two trainers on one parameter server keep separate gradients in separate contexts") {
  run_world(3, [](int rank) {
    if (rank != 0) return;
    auto a = rpc_async<&train_once>(1, 2);
    auto b = rpc_async<&train_once>(2, 5);
    EXPECT(close(a.wait(30s), at::full({2}, 2.0)));
    EXPECT(close(b.wait(30s), at::full({2}, 5.0)));
    ps_forget();
    expect_no_contexts(3);
  });
}

TEST_CASE("an exception inside a remote backward reaches the caller") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    auto x = at::rand({2}).set_requires_grad(true);
    {
      da::Context ctx;
      auto y = rpc_sync<&fragile>(1, x);
      auto msg = EXPECT_THROWS_AS(ctx.backward({y.sum()}).wait(30s), RemoteError);
      EXPECT(msg.find("backward exploded") != std::string::npos);
    }
    expect_no_contexts(2);
  });
}

TEST_CASE("a context's release handled before the request that brings it: the request does not create it again") {
  run_world(2, [](int rank) {
    if (rank != 0) return;
    da::Context ctx;
    // The release a peer sends, delivered ahead of the tensor that carries the context: what happens when worker1's
    // pool runs the two jobs out of order. Called by the name the compiler gives the library's own function.
    rpc_async<void>(1, "corpc::dist_autograd::{anonymous}::release_context", ctx.id(), 0).wait();
    auto x = at::ones({4}).set_requires_grad(true);
    EXPECT_EQ(rpc_sync<&times_three_sum>(1, x).item<double>(), 12.0);
    EXPECT_EQ(da::live_contexts(1).wait(), 0u);  // not recreated: it would be held until worker1 exits
  });
}

}  // namespace test_dist_autograd
