// Pipeline schedules against the unsplit model in one process; memory of 1F1B against GPipe; balancing; a dead stage.
#include <doctest/doctest.h>
#include <signal.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>
#include <unistd.h>

#include <cmath>
#include <map>
#include <utility>

#include "corpc/pipeline/pipeline.hpp"
#include "corpc/pipeline/schedule_csv.hpp"

#include "resnet_shards.hpp"
#include "stop_process.hpp"
#include "support.hpp"

namespace test_pipeline {  // this file's names, apart from the files it shares an executable with

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

// The batch most cases train on, and one SGD step of the unsplit model on it in this process.
struct Reference {
  at::Tensor x, y, loss;
  std::vector<at::Tensor> params;
};
Reference reference_batch(at::Tensor (*loss_fn)(const at::Tensor&, const at::Tensor&) = &mse) {
  Reference r{random_images(kBatch, kImage, 7), one_hot_labels(kBatch, kClasses, 8), {}, {}};
  std::tie(r.loss, r.params) = reference_step(r.x, r.y, loss_fn);
  return r;
}

// The pipeline's parameters after a step against the one-process reference's, one by one.
void expect_same_parameters(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& ref_params) {
  EXPECT_EQ(params.size(), ref_params.size());
  for (std::size_t i = 0; i < params.size(); ++i)
    if (!close(params[i], ref_params[i])) throw std::runtime_error("parameter " + std::to_string(i) + " differs");
}

// `balance` empty: an even cut.
PipelineOptions layout(Schedule schedule, int stages, int micro_batches, std::vector<int> balance = {}) {
  PipelineOptions o;
  o.schedule = schedule;
  o.micro_batches = micro_batches;
  const int workers = stages / min_stages_per_worker(schedule);
  for (int w = 1; w <= workers; ++w) o.workers.push_back("worker" + std::to_string(w) + "/cpu");
  o.balance = !balance.empty() ? std::move(balance)
              : stages == 2    ? std::vector<int>{5, 6}
                               : std::vector<int>{3, 3, 3, 2};
  return o;
}

}  // namespace

TEST_CASE("every schedule's order is complete and deadlock-free, with the bubble and peak memory of its formulas") {
  for (auto s : kAllSchedules)
    for (int K = 1; K <= 4; ++K)
      for (int M = 1; M <= 8; ++M) {
        const int v = min_stages_per_worker(s);
        auto plan = make_schedule(s, K, v, M);
        INFO(to_string(s) << " K=" << K << " M=" << M);
        const auto workers = check_schedule(plan, K * v);  // throws on a deadlock, a missing or a doubled action
        REQUIRE(workers == stage_workers(placement_of(s), K, K * v));
        const double span = simulate_schedule(plan, K * v, M);
        const double bubble = 1.0 - 3.0 * v * M / span;  // each worker works 3 units per stage and micro-batch
        const bool whole_rounds = M % K == 0;
        if ((s != Schedule::Interleaved1F1B && s != Schedule::LoopedBFS) || whole_rounds)
          REQUIRE(bubble == doctest::Approx(bubble_formula(s, K, v, M)));
        const auto peaks = count_peak_held(plan);
        for (int r = 0; r < K; ++r)
          if (s != Schedule::Interleaved1F1B || whole_rounds)
            REQUIRE(peaks[r] / double(v) == doctest::Approx(peak_held_formula(s, K, v, M, r)));
      }
}

TEST_CASE(
    "zero bubble and V placement shrink the bubble: at 2 workers and 8 micro-batches, ZBV's is a fifth of 1F1B's") {
  CHECK(bubble_formula(Schedule::ZBVZeroBubble, 2, 2, 8) < 0.2 * bubble_formula(Schedule::OneFOneB, 2, 1, 8));
  CHECK(bubble_formula(Schedule::InterleavedZeroBubble, 4, 2, 8) < bubble_formula(Schedule::Interleaved1F1B, 4, 2, 8));
  CHECK(bubble_formula(Schedule::DualPipeV, 4, 2, 8) < bubble_formula(Schedule::OneFOneB, 4, 1, 8));
  // Memory: ZBV holds what 1F1B holds on its first worker; LoopedBFS, like GPipe, all M.
  CHECK(peak_held_formula(Schedule::ZBVZeroBubble, 2, 2, 8, 0) == peak_held_formula(Schedule::OneFOneB, 2, 1, 8, 0));
  CHECK(peak_held_formula(Schedule::LoopedBFS, 2, 2, 8, 0) == 8);
}

TEST_CASE("schedules as PyTorch's CSV action lists: every schedule round-trips, comms and idle cells are skipped") {
  for (auto s : kAllSchedules)
    for (int M : {1, 3, 8}) {
      auto plan = make_schedule(s, 2, min_stages_per_worker(s), M);
      INFO(to_string(s) << " M=" << M << "\n" << schedule_to_csv(plan));
      REQUIRE(parse_schedule_csv(schedule_to_csv(plan)) == plan);
    }
  // As PyTorch writes them: a "with comms" grid with idle cells, CRLF line ends, an overlapped pair.
  auto plan = parse_schedule_csv(
      "0F0,0SEND_F0,,0RECV_B0,0B0\r\n"
      "1RECV_F0, 1F0 ,1B0,1SEND_B0\r\n");
  REQUIRE(plan.size() == 2);
  CHECK(plan[0] == std::vector<Action>{{ActionKind::Forward, 0, 0}, {ActionKind::Backward, 0, 0}});
  CHECK(plan[1] == std::vector<Action>{{ActionKind::Forward, 1, 0}, {ActionKind::Backward, 1, 0}});
  auto pair = parse_schedule_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n");
  REQUIRE(pair.size() == 1);
  CHECK(pair[0].at(1) == Action{ActionKind::Forward, 0, 1, true});
  CHECK(pair[0].at(2) == Action{ActionKind::Backward, 0, 0});
  CHECK_THROWS_WITH_AS(parse_schedule_csv("0F0,0X0\n"), doctest::Contains("'0X0'"), UsageError);
  CHECK_THROWS_WITH_AS(parse_schedule_csv("0F0,0UNSHARD\n"), doctest::Contains("UNSHARD"), UsageError);
  CHECK_THROWS_WITH_AS(parse_schedule_csv("0F\n"), doctest::Contains("row 0"), UsageError);
}

TEST_CASE("a schedule given as data is checked before it runs: deadlock, missing or doubled actions, memory") {
  auto csv = [](const char* text) { return parse_schedule_csv(text); };
  // Worker 1 waits for a gradient before running the forward that worker 0's backward needs: deadlock.
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0B0\n1B0,1F0\n"), 2), doctest::Contains("backward before forward"),
                       UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"), 2), doctest::Contains("deadlock"),
                       UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0\n1F0,1B0\n"), 2), doctest::Contains("one backward"), UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0I0\n1F0,1B0\n"), 2), doctest::Contains("without its W"), UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0W0,0I0\n1F0,1B0\n"), 2), doctest::Contains("before its I"), UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0F0,0B0\n1F0,1B0\n"), 2), doctest::Contains("twice"), UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0B0\n0F0\n"), 2), doctest::Contains("two workers"), UsageError);
  CHECK_THROWS_WITH_AS(check_schedule(csv("0F0,0B0\n"), 2), doctest::Contains("no action for stage 1"), UsageError);
  // GPipe's order holds all 8 micro-batches; a bound of 4 rejects it, 1F1B's order passes.
  CHECK_THROWS_WITH_AS(check_schedule(make_schedule(Schedule::GPipe, 2, 1, 8), 2, 4), doctest::Contains("holds 8"),
                       UsageError);
  CHECK_NOTHROW(check_schedule(make_schedule(Schedule::OneFOneB, 2, 1, 8), 2, 4));
}

TEST_CASE(
    "every schedule, with 2 and 4 stages, 1, 2, 4, 8 micro-batches and uneven cuts, equals the unsplit model in one "
    "process") {
  run_world(
      5,
      [](int rank) {
        if (rank != 0) return;
        const auto [x, y, ref_loss, ref_params] = reference_batch();
        // Whatever the cut (a schedule balance picks any), the results are the unsplit model's: one stage of one
        // layer, one of most layers, the heavy stage first or last.
        const std::map<int, std::vector<std::vector<int>>> cuts{
            {2, {{5, 6}, {1, 10}, {9, 2}, {10, 1}}}, {4, {{3, 3, 3, 2}, {1, 1, 1, 8}, {6, 2, 1, 2}, {2, 5, 3, 1}}}};
        for (auto schedule : kAllSchedules)
          for (int stages : {2, 4})
            for (int micro : {1, 2, 4, 8}) {
              const auto& cut = cuts.at(stages)[static_cast<std::size_t>(std::log2(micro))];  // 1, 2, 4, 8: 0..3
              auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(layout(schedule, stages, micro, cut),
                                                                          std::uint64_t{1});
              pipe.train(
                  false);  // BatchNorm in eval mode: micro-batches then compute exactly what the whole batch does
              auto result = sync_wait(pipe.train_step(x, y));
              auto params = pipe.parameters();
              INFO(to_string(schedule) << ", " << stages << " stages, " << micro << " micro-batches, cut " << cut[0]
                                       << "," << cut[1] << (stages == 4 ? ",..." : ""));
              EXPECT(close(result.loss, ref_loss));
              expect_same_parameters(params, ref_params);
              auto plan = pipe.plan(micro);
              for (std::size_t w = 0; w < result.workers.size(); ++w)
                EXPECT_EQ(result.workers[w].records.size(), plan[w].size());
            }
      },
      quick_options(), std::chrono::seconds(400));
}

TEST_CASE("a schedule read from CSV runs like the one it was written from, and fixes M") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        const auto [x, y, ref_loss, ref_params] = reference_batch();
        char path[] = "/tmp/corpc_schedule_XXXXXX";
        ::close(::mkstemp(path));
        write_schedule_csv(path, make_schedule(Schedule::ZBVZeroBubble, 2, 2, 4));
        PipelineOptions o = layout(Schedule::OneFOneB, 4, 1);  // four stages on two workers; schedule, M ignored
        o.workers.resize(2);
        o.custom_actions = read_schedule_csv(path);
        ::unlink(path);
        auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(o, std::uint64_t{1});
        EXPECT_EQ(pipe.micro_batches(), 4);
        pipe.train(false);
        auto result = sync_wait(pipe.train_step(x, y));
        EXPECT(close(result.loss, ref_loss));
        auto params = pipe.parameters();
        expect_same_parameters(params, ref_params);
        // The V placement came from the file: worker 0 ran stages 0 and 3.
        EXPECT(result.workers.at(0).stages == (std::vector<std::int32_t>{0, 3}));
        // A batch that cuts into another number of micro-batches than the file's: UsageError before anything runs.
        EXPECT_THROWS_AS(sync_wait(pipe.train_step(x.narrow(0, 0, 2), y.narrow(0, 0, 2))), UsageError);
        // An overlapped pair whose forward cannot come first: worker 2 reaches (1F1;1B0) before 0F1 is computed,
        // which waits for 0B0, which needs 1B0. Only starting the pair with its backward completes the step.
        o.custom_actions = parse_schedule_csv("0F0,0B0,0F1,0B1\n1F0,(1F1;1B0)OVERLAP_F_B,1B1\n");
        o.balance = {5, 6};
        auto paired = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(o, std::uint64_t{1});
        paired.train(false);
        auto paired_result = sync_wait(paired.train_step(x, y));
        EXPECT(close(paired_result.loss, ref_loss));
        expect_same_parameters(paired.parameters(), ref_params);
        const auto& order = paired_result.workers[1].records;
        EXPECT_EQ(order.at(1).action, (Action{ActionKind::Backward, 1, 0}));
        // A V places exactly two stages per worker: six stages on two workers are refused before anything is built.
        PipelineOptions six = layout(Schedule::ZBVZeroBubble, 4, 4);
        six.balance = {2, 2, 2, 2, 2, 1};
        EXPECT_CONTAINS(
            EXPECT_THROWS_AS((Pipeline::create<&tiny_resnet, &mse, &make_sgd>(six, std::uint64_t{1})), UsageError),
            "exactly two stages per worker");
        o.max_held_per_worker = 1;
        EXPECT_CONTAINS(
            EXPECT_THROWS_AS((Pipeline::create<&tiny_resnet, &mse, &make_sgd>(o, std::uint64_t{1})), UsageError),
            "bound is 1");
      },
      quick_options(), std::chrono::seconds(120));
}

TEST_CASE("micro-batches of different shapes: a last smaller one, and another image size in the next step") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        // Step 1: 7 images cut into 4 micro-batches (2, 2, 2, 1); step 2: 6 images twice the size, same pipeline.
        std::vector<std::pair<at::Tensor, at::Tensor>> steps{
            {random_images(7, kImage, 7), one_hot_labels(7, kClasses, 8)},
            {random_images(6, 2 * kImage, 9), one_hot_labels(6, kClasses, 10)}};
        auto net = tiny_resnet(1);
        net->eval();
        torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(kLr));
        std::vector<at::Tensor> ref_losses;
        for (auto& [x, y] : steps) {
          opt.zero_grad();
          auto loss = mse(net->forward(x), y);
          loss.backward();
          opt.step();
          ref_losses.push_back(loss.detach());
        }
        for (auto schedule : {Schedule::OneFOneB, Schedule::ZBVZeroBubble, Schedule::DualPipeV}) {
          auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(
              layout(schedule, 2 * min_stages_per_worker(schedule), 4), std::uint64_t{1});
          pipe.train(false);
          INFO(to_string(schedule));
          for (std::size_t i = 0; i < steps.size(); ++i)
            EXPECT(close(sync_wait(pipe.train_step(steps[i].first, steps[i].second)).loss, ref_losses[i]));
          auto params = pipe.parameters();
          auto ref_params = net->parameters();
          expect_same_parameters(params, ref_params);
        }
      },
      quick_options(), std::chrono::seconds(120));
}

TEST_CASE("a sum-reduced loss, declared as such, gives the one-process loss and gradients (not divided by M)") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        const auto [x, y, ref_loss, ref_params] = reference_batch(&summed_mse);
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
          expect_same_parameters(params, ref_params);
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

TEST_CASE("each layer's F, I and W are profiled, the first layer's backward all W, and cut for the schedule") {
  launch_processes(  // a child, for the reason of the case above
      1,
      [](int) {
        auto net = tiny_resnet(1);
        const auto costs = profile_layer_costs(net, random_images(4, kImage, 3), 1);
        EXPECT_EQ(costs.size(), net->size());
        for (auto& c : costs) EXPECT(c.forward > 0 && c.backward_input >= 0 && c.backward_weight >= 0);
        EXPECT(costs[0].backward_input == 0);  // the input needs no gradient, as the first stage's does not
        EXPECT(costs[0].backward_weight > 0);  // the stem's convolution has weights
        for (auto& p : net->parameters()) EXPECT(!p.grad().defined());
        for (Schedule s : kAllSchedules) {
          const auto cut = balance_for_schedule(costs, s, 2, 4);
          EXPECT_EQ(cut.balance.size(), static_cast<std::size_t>(2 * min_stages_per_worker(s)));
          EXPECT(cut.simulated_seconds <= cut.partition_seconds);
          // The same through a Pipeline's options.
          auto o = layout(s, 2 * min_stages_per_worker(s), 4);
          EXPECT(balance_for_pipeline(o, costs).balance == cut.balance);
          o.custom_actions = make_schedule(s, 2, min_stages_per_worker(s), 4);  // the same order, given as data
          EXPECT(balance_for_pipeline(o, costs).balance == cut.balance);
        }
      },
      launch_options(std::chrono::seconds(120)));
}

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

TEST_CASE("a cut refined from a real step's timeline: calibrated to its span, and the new cut equals one process") {
  run_world(
      3,
      [](int rank) {
        if (rank != 0) return;
        const auto [x, y, ref_loss, ref_params] = reference_batch();
        auto net = tiny_resnet(1);
        net->eval();  // the mode the pipelines train in below
        const auto profile = profile_layer_costs(net, random_images(kBatch / 4, kImage, 3), 1);
        for (auto schedule : {Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::ZBVZeroBubble}) {
          INFO(to_string(schedule));
          auto costs = profile;
          auto o = layout(schedule, 2 * min_stages_per_worker(schedule), 4);
          o.balance = balance_for_pipeline(o, costs).balance;
          auto pipe = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(o, std::uint64_t{1});
          pipe.train(false);
          sync_wait(pipe.train_step(x, y));
          const auto step = sync_wait(pipe.train_step(x, y));
          const auto next = refine_balance_for_pipeline(o, costs, step.workers);
          EXPECT(costs != profile);  // calibrated
          EXPECT(next.send_seconds >= 0);
          // Calibrated with this step, the simulation of its cut lasts the step's span (or longer, with no time left
          // to charge to messages).
          const double span = step_span_seconds(step.workers);
          const double replay = simulated_step_seconds(schedule, 2, min_stages_per_worker(schedule), 4, costs,
                                                       o.balance, next.send_seconds);
          if (next.send_seconds > 0) EXPECT(std::abs(replay - span) <= 1e-3 * span);
          else EXPECT(replay >= span * (1 - 1e-9));
          EXPECT(next.simulated_seconds <= replay + 1e-12);  // the chosen cut is never slower in the simulation
          // Whatever cut it gives, the step is the unsplit model's.
          o.balance = next.balance;
          auto refined = Pipeline::create<&tiny_resnet, &mse, &make_sgd>(o, std::uint64_t{1});
          refined.train(false);
          EXPECT(close(sync_wait(refined.train_step(x, y)).loss, ref_loss));
          expect_same_parameters(refined.parameters(), ref_params);
          // A balance that is not a cut of the profile is refused, the profile left as it was.
          auto wrong = o;
          wrong.balance = {1, 1};
          auto before = costs;
          EXPECT_THROWS_AS(refine_balance_for_pipeline(wrong, costs, step.workers), UsageError);
          EXPECT(costs == before);
        }
      },
      quick_options(), std::chrono::seconds(180));
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
      EXPECT_CONTAINS(msg, "worker2");
      EXPECT_CONTAINS(msg, "stage 1");
    });
  });
}

TEST_CASE(
    "a stage's worker stopped mid-step (SIGSTOP): the step fails with PipelineError naming it once it is silent") {
  RpcOptions options = quick_options();
  // A stopped peer answers no heartbeat: declared unreachable after this (stretched when sanitized).
  options.liveness_timeout = std::chrono::seconds(2) * time_scale();
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

}  // namespace test_pipeline
