// Pipeline schedules against the unsplit model in one process; memory of 1F1B against GPipe; balancing; a dead stage.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <utility>

#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include "corpc/pipeline/pipeline.hpp"
#include "resnet_shards.hpp"
#include "stop_process.hpp"
#include "support.hpp"

using namespace corpc;
using namespace corpc::test;
using namespace corpc::examples;
using namespace corpc::pipeline;

namespace {

// Tiny but structurally ResNet50: 4 + 4 + 3 = 11 layers, every kind of Bottleneck and downsample.
const std::int64_t kWidth = 2, kClasses = 10, kImage = 16, kBatch = 8;
const std::vector<std::int64_t> kBlocks{1, 1, 1, 1};
const double kLr = 0.05;

at::Tensor mse(const at::Tensor& out, const at::Tensor& target) { return torch::nn::functional::mse_loss(out, target); }
at::Tensor summed_mse(const at::Tensor& out, const at::Tensor& target) {
  return torch::nn::functional::mse_loss(out, target, torch::nn::functional::MSELossFuncOptions(torch::kSum));
}
std::unique_ptr<torch::optim::Optimizer> make_sgd(std::vector<at::Tensor> params) {
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(kLr));
}
torch::nn::Sequential tiny_resnet(std::uint64_t seed) {
  return make_resnet_sequential(kWidth, kBlocks, kClasses, seed);
}

// Float32 with the batch cut into micro-batches: the loss mean and every weight gradient become sums of per-micro-
// batch partial sums, a different order of float additions than the whole batch's; over a few hundred terms of
// similar magnitude that moves results by some 1e-6 relative. 1e-4 relative (plus 1e-6 absolute for values near
// zero) leaves room for that and still catches any wrong scaling, missing or doubled micro-batch (>= 1e-1).
bool close(const at::Tensor& a, const at::Tensor& b) { return at::allclose(a, b, 1e-4, 1e-6); }

// One SGD step of the unsplit model in this process; returns (loss, parameters after the step).
std::pair<at::Tensor, std::vector<at::Tensor>> reference_step(const at::Tensor& x, const at::Tensor& y,
                                                              at::Tensor (*loss_fn)(const at::Tensor&,
                                                                                    const at::Tensor&) = &mse) {
  auto net = tiny_resnet(1);
  net->eval();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr));
  auto loss = loss_fn(net->forward(x), y);
  loss.backward();
  opt.step();
  return {loss.detach(), net->parameters()};
}

PipelineOptions layout(Schedule schedule, int stages, int micro_batches) {
  PipelineOptions o;
  o.schedule = schedule;
  o.micro_batches = micro_batches;
  const int workers = schedule == Schedule::Interleaved1F1B ? stages / 2 : stages;
  for (int w = 1; w <= workers; ++w) o.workers.push_back("worker" + std::to_string(w) + "/cpu");
  o.balance = stages == 2 ? std::vector<int>{5, 6} : std::vector<int>{3, 3, 3, 2};
  return o;
}

}  // namespace

TEST_CASE("every schedule's order is complete and deadlock-free, with the bubble of its formula") {
  for (auto s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::ZeroBubbleH1})
    for (int K = 1; K <= 4; ++K)
      for (int M = 1; M <= 8; ++M) {
        const int v = s == Schedule::Interleaved1F1B ? 2 : 1;
        auto plan = make_schedule(s, K, v, M);
        const double span = simulate_schedule(plan, K * v, M);  // throws on a deadlock or a missing backward
        const double bubble = 1.0 - 3.0 * v * M / span;         // each worker works 3 units per stage and micro-batch
        INFO(to_string(s) << " K=" << K << " M=" << M);
        if (s != Schedule::Interleaved1F1B || M % K == 0)
          REQUIRE(bubble == doctest::Approx(bubble_formula(s, K, v, M)));
      }
}

TEST_CASE("every schedule, with 2 and 4 stages and 1, 2, 4, 8 micro-batches, equals the unsplit model in one process") {
  run_world(
      5,
      [](int rank) {
        if (rank != 0) return;
        auto x = random_images(kBatch, kImage, 7);
        auto y = one_hot_labels(kBatch, kClasses, 8);
        auto [ref_loss, ref_params] = reference_step(x, y);
        for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::ZeroBubbleH1})
          for (int stages : {2, 4})
            for (int micro : {1, 2, 4, 8}) {
              auto pipe =
                  Pipeline::create<&tiny_resnet, &mse, &make_sgd>(layout(schedule, stages, micro), std::uint64_t{1});
              pipe.train(
                  false);  // BatchNorm in eval mode: micro-batches then compute exactly what the whole batch does
              auto result = sync_wait(pipe.train_step(x, y));
              auto params = pipe.parameters();
              INFO(to_string(schedule) << ", " << stages << " stages, " << micro << " micro-batches");
              EXPECT(close(result.loss, ref_loss));
              EXPECT_EQ(params.size(), ref_params.size());
              for (std::size_t i = 0; i < params.size(); ++i) EXPECT(close(params[i], ref_params[i]));
              auto plan = pipe.plan(micro);
              for (std::size_t w = 0; w < result.workers.size(); ++w)
                EXPECT_EQ(result.workers[w].records.size(), plan[w].size());
            }
      },
      quick_options(), std::chrono::seconds(300));
}

TEST_CASE("a sum-reduced loss, declared as such, gives the one-process loss and gradients (not divided by M)") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        auto x = random_images(kBatch, kImage, 7);
        auto y = one_hot_labels(kBatch, kClasses, 8);
        auto [ref_loss, ref_params] = reference_step(x, y, &summed_mse);
        for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
          PipelineOptions o = layout(schedule, 2, 4);
          o.loss_reduction = LossReduction::sum;
          auto pipe = Pipeline::create<&tiny_resnet, &summed_mse, &make_sgd>(o, std::uint64_t{1});
          pipe.train(false);
          auto result = sync_wait(pipe.train_step(x, y));
          auto params = pipe.parameters();
          INFO(to_string(schedule) << ": loss " << result.loss.item<double>() << ", one process "
                                   << ref_loss.item<double>());
          EXPECT(close(result.loss, ref_loss));
          EXPECT_EQ(params.size(), ref_params.size());
          for (std::size_t i = 0; i < params.size(); ++i) EXPECT(close(params[i], ref_params[i]));
        }
      },
      quick_options(), std::chrono::seconds(120));
}

TEST_CASE("inputs and targets of different batch sizes are a UsageError naming both, before anything is sent") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(layout(Schedule::GPipe, 2, 4), std::uint64_t{1});
        // 4 against 8 chunks into 4 micro-batches each: counting micro-batches alone would train on broadcast targets.
        for (auto [n_in, n_out] : {std::pair<long, long>{4, 8}, {kBatch, kBatch - 1}}) {
          try {
            sync_wait(pipe.train_step(random_images(n_in, kImage, 7), one_hot_labels(n_out, kClasses, 8)));
            EXPECT(!"train_step accepted mismatched batches");
          } catch (const UsageError& e) {
            EXPECT_CONTAINS(std::string(e.what()),
                            std::to_string(n_in) + " inputs, " + std::to_string(n_out) + " targets");
          }
        }
        auto result = sync_wait(pipe.train_step(random_images(kBatch, kImage, 7), one_hot_labels(kBatch, kClasses, 8)));
        EXPECT(std::isfinite(result.loss.item<double>()));  // refusals sent nothing: the pipeline still steps
      },
      quick_options(), std::chrono::seconds(120));
}

TEST_CASE("1F1B frees each micro-batch's activations: at 8 micro-batches and 2 stages, a quarter of GPipe's peak") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        auto x = random_images(32, 32, 7);
        auto y = one_hot_labels(32, kClasses, 8);
        std::map<Schedule, std::vector<WorkerReport>> reports;
        for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
          auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(layout(schedule, 2, 8), std::uint64_t{1});
          sync_wait(pipe.train_step(x, y));  // the first step also allocates gradients and optimizer state
          reports[schedule] = sync_wait(pipe.train_step(x, y)).workers;
        }
        // Micro-batches held at once: exactly the schedule's formula.
        for (auto schedule : {Schedule::GPipe, Schedule::OneFOneB, Schedule::ZeroBubbleH1})
          for (int r = 0; r < 2; ++r)
            EXPECT_EQ(reports[schedule][r].peak_micro_batches_held,
                      static_cast<int>(peak_held_formula(schedule, 2, 1, 8, r)));
        // Bytes: stage 0 holds 2 of 8 micro-batches under 1F1B. The constant: one micro-batch's worth of GPipe's peak,
        // for what any schedule allocates transiently (a backward's gradient buffers, the received activation).
        const double gpipe = static_cast<double>(reports[Schedule::GPipe][0].peak_activation_bytes);
        const double one_f_one_b = static_cast<double>(reports[Schedule::OneFOneB][0].peak_activation_bytes);
        std::fprintf(stderr, "peak activation bytes of stage 0 at 8 micro-batches: GPipe %.0f, 1F1B %.0f (%.3f)\n",
                     gpipe, one_f_one_b, one_f_one_b / gpipe);
        EXPECT(gpipe > 0);
        EXPECT(one_f_one_b <= 2.0 / 8.0 * gpipe + gpipe / 8.0);
      },
      quick_options(), std::chrono::seconds(120));
}

TEST_CASE("balancing puts every layer on exactly one stage and minimizes the slowest stage") {
  REQUIRE((partition_by_cost({1, 1, 1, 1, 4}, 2) == std::vector<int>{4, 1}));
  REQUIRE((partition_by_cost({5, 1, 1, 1, 1, 1}, 2) == std::vector<int>{1, 5}));
  REQUIRE((partition_by_cost({1, 2, 3}, 3) == std::vector<int>{1, 1, 1}));
  CHECK_THROWS_AS(partition_by_cost({1, 2}, 3), UsageError);
  // Profiling runs backward passes: in a child, because a process that has run one cannot fork ranks that use
  // autograd on libtorch builds with a device thread (Debian 13's 2.6 registers Vulkan), and later cases fork.
  launch_processes(
      1,
      [](int) {
        auto net = tiny_resnet(1);
        for (int stages : {1, 2, 4, 11}) {
          auto balance = balance_by_time(net, random_images(4, kImage, 3), stages, 1);
          EXPECT_EQ(balance.size(), static_cast<std::size_t>(stages));
          int total = 0;
          for (int b : balance) {
            EXPECT(b >= 1);
            total += b;
          }
          EXPECT_EQ(total, static_cast<int>(net->size()));
        }
      },
      launch_options(std::chrono::seconds(120)));
}

namespace {
std::atomic<int> g_calls{0};
// A layer whose worker dies the second time it runs.
struct DoomImpl : torch::nn::Module {
  at::Tensor forward(at::Tensor x) {
    if (++g_calls == 2) ::raise(SIGKILL);
    return x;
  }
};
TORCH_MODULE(Doom);
int pid_of() { return static_cast<int>(::getpid()); }

torch::nn::Sequential doomed_resnet(std::uint64_t seed) {
  auto net = tiny_resnet(seed);
  net->push_back("doom", Doom());
  return net;
}
}  // namespace

TEST_CASE("refining a balance with measured stage times moves the cut toward the stage that was underestimated") {
  // The profile says 4 equal layers; a real step measured stage 0 (layers 0-1) at three times its prediction.
  std::vector<double> costs{1, 1, 1, 1};
  auto next = refine_balance(costs, {2, 2}, {6.0, 2.0});
  CHECK((next == std::vector<int>{1, 3}));  // costs are now 3 3 1 1: 3 | 5 beats 6 | 2
  CHECK((costs == std::vector<double>{3, 3, 1, 1}));
  // Measured as predicted: the same balance comes back (refinement has converged).
  std::vector<double> even{1, 1, 1, 1};
  CHECK((refine_balance(even, {2, 2}, {2.0, 2.0}) == std::vector<int>{2, 2}));
  // A stage that ran nothing keeps its profile.
  std::vector<double> idle{1, 2, 3};
  CHECK((refine_balance(idle, {1, 2}, {0.0, 5.0}) == partition_by_cost({1, 2, 3}, 2)));
  CHECK_THROWS_AS(refine_balance(idle, {1, 1}, {1.0, 1.0}), UsageError);  // does not cover every layer
  CHECK((idle == std::vector<double>{1, 2, 3}));                          // and a refusal changes nothing
  CHECK_THROWS_AS(refine_balance(idle, {1, 2}, {1.0}), UsageError);       // one time per stage
  // stage_busy_seconds sums each stage's actions from a step's timeline.
  WorkerReport w;
  w.records.push_back({Action{ActionKind::Forward, 0, 0}, 1, 0, 2'000'000'000});
  w.records.push_back({Action{ActionKind::Backward, 1, 0}, 1, 3'000'000'000, 4'000'000'000});
  w.records.push_back({Action{ActionKind::Backward, 0, 0}, 1, 5'000'000'000, 5'500'000'000});
  auto busy = stage_busy_seconds({w}, 2);
  CHECK(busy[0] == doctest::Approx(2.5));
  CHECK(busy[1] == doctest::Approx(1.0));
}

TEST_CASE("a stage's worker killed mid-step fails the step with PipelineError naming it, without a hang") {
  expect_only_rank_lost(2, "", [&] {
    run_world(3, [](int rank) {
      if (rank != 0) return;
      auto o = layout(Schedule::OneFOneB, 2, 4);
      o.balance = {5, 7};  // the doomed layer is on stage 1, worker2
      auto pipe = Pipeline::create<&doomed_resnet, &mse, &make_sgd>(o, std::uint64_t{1});
      auto msg = EXPECT_THROWS_AS(
          sync_wait(pipe.train_step(random_images(kBatch, kImage, 7), one_hot_labels(kBatch, kClasses, 8))),
          PipelineError);
      EXPECT(msg.find("worker2") != std::string::npos);
      EXPECT(msg.find("stage 1") != std::string::npos);
    });
  });
}

TEST_CASE(
    "a stage's worker stopped mid-step (SIGSTOP): the step fails with PipelineError naming it once it is silent") {
  RpcOptions options = quick_options();
  options.liveness_timeout =
      std::chrono::seconds(2);  // a stopped peer answers no heartbeat: declared unreachable after this
  expect_only_rank_lost(2, "", [&] {
    run_world(
        3,
        [](int rank) {
          if (rank != 0) return;
          auto pipe =
              Pipeline::create<&tiny_resnet, &mse, &make_sgd>(layout(Schedule::OneFOneB, 2, 4), std::uint64_t{1});
          const pid_t pid = rpc_sync<&pid_of>(2);
          stop_process(pid);
          auto msg = EXPECT_THROWS_AS(
              sync_wait(pipe.train_step(random_images(kBatch, kImage, 7), one_hot_labels(kBatch, kClasses, 8))),
              PipelineError);
          EXPECT(msg.find("worker2") != std::string::npos);
          ::kill(pid, SIGKILL);  // it would find every connection closed when continued; the test ends it
        },
        options);
  });
}

namespace {
std::atomic<int> g_backward_runs{0};
// An identity whose backward counts its runs. It sits between a layer's two weights, so a W that walked the layer's
// graph again from the layer's output (to reach the first weight) would run it a second time.
struct CountedIdentity : torch::autograd::Function<CountedIdentity> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    ++g_backward_runs;
    return grads;
  }
};
struct SandwichImpl : torch::nn::Module {
  SandwichImpl() : a(register_module("a", torch::nn::Linear(8, 8))), b(register_module("b", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(at::Tensor x) { return b(torch::relu(CountedIdentity::apply(a(x)))); }
  torch::nn::Linear a, b;
};
TORCH_MODULE(Sandwich);
torch::nn::Sequential sandwiches(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(Sandwich(), Sandwich(), Sandwich());
}
int take_backward_runs() { return g_backward_runs.exchange(0); }
}  // namespace

TEST_CASE("zero bubble's W computes no activation gradient again: a node between two weights runs once a micro-batch") {
  run_world(
      4,
      [](int rank) {
        if (rank != 0) return;
        torch::manual_seed(3);
        const auto x = torch::randn({kBatch, 8}), y = torch::randn({kBatch, 8});
        auto net = sandwiches(1);
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr));
        auto ref_loss = mse(net->forward(x), y);
        ref_loss.backward();
        opt.step();
        const int micro = 4;
        for (auto schedule : {Schedule::OneFOneB, Schedule::ZeroBubbleH1}) {
          PipelineOptions o;
          o.schedule = schedule;
          o.micro_batches = micro;
          o.workers = {"worker1/cpu", "worker2/cpu", "worker3/cpu"};
          // Stage 0 has no input gradient to send: its W runs the whole backward. Stages 1 and 2 split it; stage 1's
          // output comes from an intermediate (b's addmm), stage 2's is the loss.
          o.balance = {1, 1, 1};
          auto pipe = Pipeline::create<&sandwiches, &mse, &make_sgd>(o, std::uint64_t{1});
          auto result = sync_wait(pipe.train_step(x, y));
          for (int worker : {1, 2, 3}) {
            const int runs = rpc_sync<&take_backward_runs>(worker);
            if (runs != micro)
              throw std::runtime_error(std::string(to_string(schedule)) + ": the counted node of stage " +
                                       std::to_string(worker - 1) + " ran its backward " + std::to_string(runs) +
                                       " times for " + std::to_string(micro) + " micro-batches");
          }
          EXPECT(close(result.loss, ref_loss.detach()));
          auto params = pipe.parameters();
          EXPECT_EQ(params.size(), net->parameters().size());
          for (std::size_t i = 0; i < params.size(); ++i) EXPECT(close(params[i], net->parameters()[i]));
        }
      },
      quick_options(), std::chrono::seconds(120));
}
