// The schedule simulator and the schedule-aware balance (corpc/pipeline/schedule_balance.hpp): hand-computed steps,
// the unit-time simulation it generalizes, and a search never worse than the slowest-stage cut. No torch, no processes.
#include <doctest/doctest.h>

#include <algorithm>
#include <vector>

#include "corpc/pipeline/schedule_balance.hpp"
#include "corpc/pipeline/timeline.hpp"

namespace test_schedule_balance {

using namespace corpc;
using namespace corpc::pipeline;

namespace {

// 23 layers shaped like ResNet50's Sequential at a small micro-batch: a heavy stem, blocks whose input and weight
// gradients differ in share, a cheap head. Not measured: deterministic, uneven on purpose.
std::vector<ActionCosts> synthetic_layers() {
  std::vector<ActionCosts> layers;
  for (int i = 0; i < 23; ++i) {
    const double f = 1.0 + (i * 7 % 5) * 0.4 + (i < 4 ? 1.5 : 0.0) - (i > 20 ? 0.8 : 0.0);
    layers.push_back({f, f * (0.6 + (i % 3) * 0.3), f * (1.4 - (i % 4) * 0.2)});
  }
  return layers;
}

}  // namespace

TEST_CASE("the simulated step of GPipe on 2 stages and 2 micro-batches is the one computed by hand") {
  // Stage 0: F 1, B 2 (I 1 + W 1); stage 1: F 2, B 3 (I 2 + W 1).
  const std::vector<ActionCosts> stages{{1, 1, 1}, {2, 2, 1}};
  const auto plan = make_schedule(Schedule::GPipe, 2, 1, 2);
  // worker 0: F0 0-1, F1 1-2; worker 1: F0 1-3, F1 3-5, B0 5-8, B1 8-11; worker 0: B0 8-10, B1 11-13.
  CHECK(simulate_step(plan, stages) == doctest::Approx(13));
  // 0.5 s per message between the workers: worker 1's F0 1.5-3.5, F1 3.5-5.5, B0 5.5-8.5, B1 8.5-11.5; worker 0's
  // B0 9-11, B1 12-14.
  CHECK(simulate_step(plan, stages, 0.5) == doctest::Approx(14));
  // The same through the schedule's name and a per-layer table cut 1 | 2.
  const std::vector<ActionCosts> layers{{1, 1, 1}, {1, 1, 0.5}, {1, 1, 0.5}};
  CHECK(simulated_step_seconds(Schedule::GPipe, 2, 1, 2, layers, {1, 2}) == doctest::Approx(13));
}

TEST_CASE("zero bubble's first stage has no I to compute, and a worker runs a later W rather than wait, as it runs") {
  // ZBV on 2 workers, 2 micro-batches, F = I = W = 1 on every stage: the first stage's I costs 0 and its W 2.
  // Worker 0 holds stages 0 and 3, worker 1 stages 1 and 2. Worker 0 reaches 0I1 at 8, before stage 1's gradient
  // (9): it runs 3W1 (8-9) first, then 0I1 (9), 0W0 (9-11), 0W1 (11-13); worker 1 ends at 13 too. Run in list order,
  // 3W1 would wait for 0I1 and the step end at 14.
  const std::vector<ActionCosts> stages(4, ActionCosts{1, 1, 1});
  const auto plan = make_schedule(Schedule::ZBVZeroBubble, 2, 2, 2);
  CHECK(simulate_step(plan, stages) == doctest::Approx(13));
}

TEST_CASE("with unit times (F = I = W = 1) and whole backwards the simulation is the schedules' own unit run") {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::LoopedBFS})
    for (int workers : {2, 4})
      for (int micro : {1, 2, 3, 4, 8}) {
        CAPTURE(to_string(s));
        CAPTURE(workers);
        CAPTURE(micro);
        const int v = min_stages_per_worker(s);
        const auto plan = make_schedule(s, workers, v, micro);
        const std::vector<ActionCosts> unit(static_cast<std::size_t>(workers * v), ActionCosts{1, 1, 1});
        CHECK(simulate_step(plan, unit) == doctest::Approx(simulate_schedule(plan, workers * v, micro)));
      }
}

TEST_CASE("for every schedule the chosen cut's simulated step is no longer than partition_by_cost's cut's") {
  const auto layers = synthetic_layers();
  std::vector<double> totals;
  for (auto& l : layers) totals.push_back(l.total());
  for (Schedule s : kAllSchedules)
    for (int workers : {2, 4})
      for (int micro : {1, 2, 4, 8}) {
        if (workers == 4 && micro != 4) continue;  // the local search's case (8 stages), once
        CAPTURE(to_string(s));
        CAPTURE(workers);
        CAPTURE(micro);
        const int v = min_stages_per_worker(s);
        const auto chosen = balance_for_schedule(layers, s, workers, micro);
        const auto partition = partition_by_cost(totals, workers * v);
        const double theirs = simulated_step_seconds(s, workers, v, micro, layers, partition);
        CHECK(chosen.partition_seconds == doctest::Approx(theirs));
        CHECK(chosen.simulated_seconds <= theirs + 1e-12);
        CHECK(chosen.simulated_seconds ==
              doctest::Approx(simulated_step_seconds(s, workers, v, micro, layers, chosen.balance)));
        CHECK(chosen.exhaustive == (workers * v <= 4));  // C(22, 3) = 1540 cuts; C(22, 7) is past the bound
        int sum = 0;
        for (int b : chosen.balance) {
          CHECK(b >= 1);
          sum += b;
        }
        CHECK(sum == 23);
      }
}

TEST_CASE("the schedule changes the best cut: a V's first worker carries both ends, a loop's does not") {
  // Four equal layers then four heavy ones: partition_by_cost evens the four stages' totals whatever the placement;
  // the search finds, for each placement, a cut at least as good, and for ZBV a strictly better one here.
  std::vector<ActionCosts> layers;
  for (int i = 0; i < 12; ++i) layers.push_back(i < 8 ? ActionCosts{1, 1, 1} : ActionCosts{3, 1, 4});
  const auto zbv = balance_for_schedule(layers, Schedule::ZBVZeroBubble, 2, 4);
  const auto loop = balance_for_schedule(layers, Schedule::Interleaved1F1B, 2, 4);
  CHECK(zbv.exhaustive);
  CHECK(zbv.simulated_seconds <= zbv.partition_seconds);
  CHECK(loop.simulated_seconds <= loop.partition_seconds);
  CHECK(zbv.balance != loop.balance);
}

TEST_CASE("calibrating a profile scales each stage's layers kind by kind; the first stage's backward as one") {
  // Four layers, F = I = W = 1, cut 2 | 2. Stage 1 measured F 4 (2 predicted), I 1 (2), W 6 (2): its layers' F
  // doubles, I halves, W triples. Stage 0 ran its backward as one W of 8 (predicted I 2 + W 2): both double.
  std::vector<ActionCosts> layers(4, ActionCosts{1, 1, 1});
  calibrate_layer_costs(layers, {2, 2}, {{2, 0, 8}, {4, 1, 6}});
  for (int l : {0, 1}) {
    CHECK(layers[l].forward == doctest::Approx(1));
    CHECK(layers[l].backward_input == doctest::Approx(2));
    CHECK(layers[l].backward_weight == doctest::Approx(2));
  }
  for (int l : {2, 3}) {
    CHECK(layers[l].forward == doctest::Approx(2));
    CHECK(layers[l].backward_input == doctest::Approx(0.5));
    CHECK(layers[l].backward_weight == doctest::Approx(3));
  }
  // A whole backward (B, in backward_input) scales I and W together; a kind measured at 0 keeps its costs.
  std::vector<ActionCosts> whole(2, ActionCosts{1, 1, 1});
  calibrate_layer_costs(whole, {1, 1}, {{0, 0, 0}, {3, 6, 0}});
  CHECK(whole[0].total() == doctest::Approx(3));
  CHECK(whole[1].forward == doctest::Approx(3));
  CHECK(whole[1].backward_input == doctest::Approx(3));
  CHECK(whole[1].backward_weight == doctest::Approx(3));
  CHECK_THROWS_AS(calibrate_layer_costs(whole, {1, 1}, {{1, 1, 1}}), UsageError);  // one measurement per stage
  CHECK_THROWS_AS(calibrate_layer_costs(whole, {1, 2}, {{1, 1, 1}, {1, 1, 1}}), UsageError);
}

TEST_CASE("the time per message fitted to a step's span is the one the step was simulated with") {
  const auto layers = synthetic_layers();
  for (Schedule s : {Schedule::OneFOneB, Schedule::Interleaved1F1B, Schedule::ZBVZeroBubble, Schedule::DualPipeV}) {
    CAPTURE(to_string(s));
    const int v = min_stages_per_worker(s);
    const auto plan = make_schedule(s, 2, v, 4);
    const auto stages = stage_costs(layers, balance_for_schedule(layers, s, 2, 4).balance);
    CHECK(fit_send_seconds(plan, stages, simulate_step(plan, stages, 0.75)) == doctest::Approx(0.75).epsilon(1e-4));
    CHECK(fit_send_seconds(plan, stages, simulate_step(plan, stages, 0)) == 0);
    CHECK(fit_send_seconds(plan, stages, 1.0) == 0);  // a span shorter than the actions: nothing to charge messages
  }
}

TEST_CASE("a step's timeline gives each stage's F, I and W per micro-batch, and its span") {
  // Stage 0: F 1 s and 3 s (mean 2), a whole B of 4 s; stage 1: I 1 s, W 2 s and 4 s (mean 3); a stage out of range
  // is left out. The span runs from the first start (0) to the last end (12 s).
  auto at = [](ActionKind k, int stage, int micro, double start, double end) {
    return ActionRecord{Action{k, stage, micro}, 1, static_cast<std::int64_t>(start * 1e9),
                        static_cast<std::int64_t>(end * 1e9)};
  };
  WorkerReport a, b;
  a.records = {at(ActionKind::Forward, 0, 0, 0, 1), at(ActionKind::Forward, 0, 1, 1, 4),
               at(ActionKind::Backward, 0, 0, 8, 12)};
  b.records = {at(ActionKind::BackwardInput, 1, 0, 4, 5), at(ActionKind::BackwardWeight, 1, 0, 5, 7),
               at(ActionKind::BackwardWeight, 1, 1, 7, 11), at(ActionKind::Forward, 5, 0, 0, 100)};
  const auto costs = stage_action_costs({a, b}, 2);
  REQUIRE(costs.size() == 2);
  CHECK(costs[0].forward == doctest::Approx(2));
  CHECK(costs[0].backward_input == doctest::Approx(4));
  CHECK(costs[0].backward_weight == 0);
  CHECK(costs[1].forward == 0);
  CHECK(costs[1].backward_input == doctest::Approx(1));
  CHECK(costs[1].backward_weight == doctest::Approx(3));
  b.records.pop_back();
  CHECK(step_span_seconds({a, b}) == doctest::Approx(12));
  CHECK(step_span_seconds({}) == 0);
}

TEST_CASE("three rounds of calibration from measured stages reach the true best cut within 1%; the profile's misses") {
  // The truth: synthetic_layers. The profile underestimates the first eight layers by 40% and overestimates the
  // last five by 30%, as a layer-at-a-time profile misjudged ResNet50's stem against its head. A "step" measures each
  // stage's true costs (what stage_action_costs reads from a real step's timeline); each round calibrates the profile
  // with them and cuts again. The profile's own cut is 5-19% slower than the best, in the true simulation.
  const auto truth = synthetic_layers();
  for (Schedule s : {Schedule::OneFOneB, Schedule::ZeroBubbleH1, Schedule::Interleaved1F1B, Schedule::DualPipeV})
    for (int micro : {2, 4, 8}) {
      CAPTURE(to_string(s));
      CAPTURE(micro);
      auto profile = truth;
      for (std::size_t l = 0; l < profile.size(); ++l) {
        const double k = l < 8 ? 0.6 : l >= 18 ? 1.3 : 1.0;
        profile[l] = {profile[l].forward * k, profile[l].backward_input * k, profile[l].backward_weight * k};
      }
      const int v = min_stages_per_worker(s);
      auto true_step = [&](const std::vector<int>& cut) { return simulated_step_seconds(s, 2, v, micro, truth, cut); };
      const double best = balance_for_schedule(truth, s, 2, micro).simulated_seconds;
      auto cut = balance_for_schedule(profile, s, 2, micro).balance;
      CHECK(true_step(cut) > 1.04 * best);
      for (int round = 0; round < 3; ++round) {
        calibrate_layer_costs(profile, cut, stage_costs(truth, cut));
        // Calibrated with a cut's measured stages, the profile predicts that cut's step exactly.
        CHECK(simulated_step_seconds(s, 2, v, micro, profile, cut) == doctest::Approx(true_step(cut)).epsilon(1e-9));
        cut = balance_for_schedule(profile, s, 2, micro).balance;
      }
      CHECK(true_step(cut) <= 1.01 * best);
    }
}

TEST_CASE("a balance that does not cover the layers one to one, or too many stages, is a UsageError") {
  const std::vector<ActionCosts> layers(3, ActionCosts{1, 1, 1});
  CHECK_THROWS_AS(stage_costs(layers, {1, 1}), UsageError);
  CHECK_THROWS_AS(stage_costs(layers, {2, 2}), UsageError);
  CHECK_THROWS_AS(stage_costs(layers, {0, 3}), UsageError);
  CHECK(stage_costs(layers, {1, 2})[1].total() == doctest::Approx(6));
  CHECK_THROWS_AS(balance_for_schedule(layers, Schedule::Interleaved1F1B, 2, 2), UsageError);  // 4 stages, 3 layers
}

}  // namespace test_schedule_balance
