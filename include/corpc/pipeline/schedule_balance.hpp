/// @file
/// A cut made for the schedule that runs: simulate the schedule's action lists with each stage's measured costs, and
/// keep the cut whose simulated step is shortest (no torch here).
///
/// ```cpp
///   // each layer's forward, input-gradient and weight-gradient seconds at the micro-batch size the pipeline runs
///   std::vector<corpc::pipeline::ActionCosts> costs = corpc::pipeline::profile_layer_costs(model, micro_batch_sample);
///   auto cut = corpc::pipeline::balance_for_schedule(costs, o.schedule, /*workers=*/2, o.micro_batches);
///   o.balance = cut.balance;  // cut.simulated_seconds: the step it predicts
/// ```
///
/// Why not the slowest stage alone (partition_by_cost): what a worker waits for depends on the schedule. A V puts the
/// first and the last stage on one worker, an interleaved loop gives each worker stages from both ends, zero bubble
/// moves the weight gradients (W) off the critical path into the waits, and the first stage's backward has no input
/// gradient to compute at all. A cut that evens the stages' totals can leave one worker carrying more of what others
/// wait for. The simulation runs the same action lists the Pipeline runs (make_schedule), with the same run-time
/// choices (an overlapped pair starts with whichever input is there; a worker whose next input has not arrived runs a
/// later W whose I is done), so it charges each cut with the waits that schedule makes.
///
/// The search: every cut when there are at most kExhaustiveCuts of them (23 layers: every 2-, 3- and 4-stage cut);
/// beyond that, a local search from partition_by_cost's cut (by each layer's whole cost) that moves one cut point, or
/// a whole stage, by up to three layers while the simulated step gets shorter. Either way the result is never
/// slower, in the simulation, than partition_by_cost's cut.
///
/// What the simulation leaves out: the loss (on the last stage), the optimizer step, and the time an activation takes
/// from one worker to another unless `send_seconds` says (a fixed latency per message between two workers; messages
/// between stages on one worker cost nothing). A profile taken one layer at a time also misses what a running stage
/// pays (caches, threads): calibrate_layer_costs corrects it with a real step's stage costs and fit_send_seconds
/// finds the time per message that step waited (refine_balance_for_pipeline in pipeline.hpp does both and cuts again).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "corpc/pipeline/action.hpp"
#include "corpc/pipeline/partition.hpp"
#include "corpc/pipeline/schedule.hpp"
#include "corpc/rpc/errors.hpp"

namespace corpc::pipeline {

/// Seconds one micro-batch spends in each kind of action, for one layer or one stage. A backward (B) is
/// backward_input + backward_weight; zero bubble runs them apart as I and W. A layer whose weight gradient cannot be
/// computed apart from its input gradient counts all of it in backward_input.
struct ActionCosts {
  double forward = 0;                                   ///< F
  double backward_input = 0;                            ///< I: the gradient of the layer's (stage's) input
  double backward_weight = 0;                           ///< W: the gradients of its weights
  bool operator==(const ActionCosts&) const = default;  ///< field by field
  /// F + I + W: a micro-batch's whole time
  double total() const noexcept { return forward + backward_input + backward_weight; }
  /// field by field
  ActionCosts& operator+=(const ActionCosts& o) noexcept {
    forward += o.forward, backward_input += o.backward_input, backward_weight += o.backward_weight;
    return *this;
  }
};

/// Each stage's costs: the sum of its layers' (`balance[s]` consecutive layers for stage s). UsageError if the
/// balance does not cover the layers one to one.
inline std::vector<ActionCosts> stage_costs(const std::vector<ActionCosts>& layers, const std::vector<int>& balance) {
  std::vector<ActionCosts> stages;
  std::size_t next = 0;
  for (int b : balance) {
    if (b < 1 || next + static_cast<std::size_t>(b) > layers.size()) break;
    ActionCosts sum;
    for (int i = 0; i < b; ++i) sum += layers[next++];
    stages.push_back(sum);
  }
  if (stages.size() != balance.size() || next != layers.size())
    throw UsageError("a balance must cover the " + std::to_string(layers.size()) +
                     " layers one to one, each stage at least one layer");
  return stages;
}

/// The step time of `plan` (one action list per worker, as make_schedule or a custom schedule gives) when stage s's
/// actions cost `stages[s]`: each worker runs its list in order, one action at a time; a forward waits for the
/// previous stage's forward of its micro-batch, a backward (B or I) for the next stage's, a W for its own I. The first
/// stage has no input gradient to compute: its I costs nothing and its W carries its whole backward, as the Pipeline
/// runs it. `send_seconds` is added to every input that comes from another worker. An overlapped pair starts with
/// its backward when only the backward's input is there at the moment the worker is free, and a worker whose next
/// input is not there runs the first later W whose I is done, as the Pipeline's workers do. Returns the time the last
/// action ends. UsageError if the plan deadlocks, has an action out of range, or `stages` has another size.
inline double simulate_step(std::vector<std::vector<Action>> plan, const std::vector<ActionCosts>& stages,
                            double send_seconds = 0) {
  const int K = static_cast<int>(plan.size()), S = static_cast<int>(stages.size());
  const int M = schedule_micro_batches(plan);
  std::vector<int> worker(S, -1);
  std::size_t remaining = 0;
  for (int r = 0; r < K; ++r)
    for (auto& a : plan[r]) {
      if (a.stage < 0 || a.stage >= S || a.micro < 0) throw UsageError("simulate_step: an action out of range");
      worker[a.stage] = r;
      ++remaining;
    }
  const double kNotYet = -1;
  // [stage][micro]: when the forward's output, the backward's input gradient, the I are done.
  std::vector<std::vector<double>> fwd(S, std::vector<double>(M, kNotYet)), grad = fwd;
  std::vector<std::vector<char>> input_done(S, std::vector<char>(M, 0));
  // When `a`'s input is there for its worker; kNotYet while the action that makes it has not been simulated.
  auto ready = [&](const Action& a) -> double {
    auto from = [&](double done, int stage) {
      return done < 0 ? kNotYet : done + (worker[stage] == worker[a.stage] ? 0 : send_seconds);
    };
    if (a.kind == ActionKind::Forward) return a.stage == 0 ? 0 : from(fwd[a.stage - 1][a.micro], a.stage - 1);
    if (a.kind == ActionKind::BackwardWeight) return input_done[a.stage][a.micro] ? 0 : kNotYet;
    if (fwd[a.stage][a.micro] < 0) return kNotYet;  // (its forward is earlier in this worker's list)
    return a.stage + 1 == S ? 0 : from(grad[a.stage + 1][a.micro], a.stage + 1);
  };
  auto cost = [&](const Action& a) {
    const ActionCosts& c = stages[a.stage];
    switch (a.kind) {
      case ActionKind::Forward: return c.forward;
      case ActionKind::Backward: return c.backward_input + c.backward_weight;
      case ActionKind::BackwardInput: return a.stage == 0 ? 0.0 : c.backward_input;
      case ActionKind::BackwardWeight: return a.stage == 0 ? c.backward_input + c.backward_weight : c.backward_weight;
    }
    return 0.0;
  };
  // Events in time order: the free worker with the earliest clock decides next. Every action not yet simulated ends
  // after that clock, so an input still unknown is an input not there yet, which is what the run-time choices ask.
  std::vector<double> clock(K, 0);
  std::vector<std::size_t> next(K, 0);
  std::vector<char> waiting(K, 0);  // its next input is unknown: nothing it can do until another action is simulated
  while (remaining) {
    int r = -1;
    for (int w = 0; w < K; ++w)
      if (next[w] < plan[w].size() && !waiting[w] && (r < 0 || clock[w] < clock[r])) r = w;
    if (r < 0) throw UsageError("simulate_step: the schedule deadlocks");
    auto& list = plan[r];
    const std::size_t i = next[r];
    const double t = clock[r];
    auto here = [&](const Action& a) {
      const double at = ready(a);
      return at >= 0 && at <= t;
    };
    if (list[i].overlap && i + 1 < list.size() && !here(list[i]) && here(list[i + 1])) {
      std::swap(list[i], list[i + 1]);
      list[i + 1].overlap = false;
    }
    if (list[i].kind != ActionKind::BackwardWeight && !here(list[i]))
      for (std::size_t j = i + 1; j < list.size(); ++j)
        if (list[j].kind == ActionKind::BackwardWeight && input_done[list[j].stage][list[j].micro]) {
          std::rotate(list.begin() + static_cast<std::ptrdiff_t>(i), list.begin() + static_cast<std::ptrdiff_t>(j),
                      list.begin() + static_cast<std::ptrdiff_t>(j) + 1);
          break;
        }
    const Action a = list[i];
    const double at = ready(a);
    if (at < 0) {
      waiting[r] = 1;
      continue;
    }
    clock[r] = std::max(t, at) + cost(a);
    if (a.kind == ActionKind::Forward) fwd[a.stage][a.micro] = clock[r];
    else if (a.kind != ActionKind::BackwardWeight) grad[a.stage][a.micro] = clock[r];
    if (a.kind == ActionKind::BackwardInput) input_done[a.stage][a.micro] = 1;
    ++next[r];
    --remaining;
    std::fill(waiting.begin(), waiting.end(), 0);
  }
  return K ? *std::max_element(clock.begin(), clock.end()) : 0;
}

/// The simulated step of `schedule` on `workers` workers, `stages_per_worker` stages each, `micro_batches`
/// micro-batches, with `layers` cut as `balance` (see simulate_step).
inline double simulated_step_seconds(Schedule schedule, int workers, int stages_per_worker, int micro_batches,
                                     const std::vector<ActionCosts>& layers, const std::vector<int>& balance,
                                     double send_seconds = 0) {
  return simulate_step(make_schedule(schedule, workers, stages_per_worker, micro_batches), stage_costs(layers, balance),
                       send_seconds);
}

/// What balance_for_schedule chose.
struct ScheduleBalance {
  std::vector<int> balance;      ///< layers per stage: PipelineOptions::balance
  double simulated_seconds = 0;  ///< the simulated step with that cut
  /// the simulated step with partition_by_cost's cut (the slowest stage's total minimized), for comparison
  double partition_seconds = 0;
  bool exhaustive = false;  ///< every cut was simulated (otherwise: the local search of this header's top)
  double send_seconds = 0;  ///< the time per message between workers the simulation charged
};

/// Corrects a layer profile with what a real step measured, so that the next balance_for_schedule simulates this
/// setting's costs: every layer of stage s (cut as `balance`) has its F scaled by measured[s].forward over the sum
/// of its layers' F, and its I and W likewise. Where the step ran a whole backward (B) rather than I and W apart, and
/// on the first stage (whose I the Pipeline runs as nothing, its W carrying the whole backward), I and W share one
/// factor: the measured backward over the predicted one. A kind measured or predicted at 0 keeps its costs. Rounds
/// compound, as refine_balance's do: the profile becomes what the running stages pay (activations gone from cache by
/// the backward, the threads a running worker has), which a profile taken one layer at a time misses.
/// `measured`: each stage's seconds per micro-batch, stage_action_costs (timeline.hpp) of one step. UsageError if
/// the balance does not cover the layers one to one or `measured` has another number of stages.
inline void calibrate_layer_costs(std::vector<ActionCosts>& layers, const std::vector<int>& balance,
                                  const std::vector<ActionCosts>& measured) {
  const auto predicted = stage_costs(layers, balance);
  if (measured.size() != predicted.size())
    throw UsageError("calibrate_layer_costs: " + std::to_string(measured.size()) +
                     " measured stages for a balance of " + std::to_string(balance.size()));
  auto factor = [](double m, double p) { return m > 0 && p > 0 ? m / p : 1.0; };
  std::size_t first = 0;
  for (std::size_t s = 0; s < predicted.size(); ++s) {
    const ActionCosts &m = measured[s], &p = predicted[s];
    const bool apart = s > 0 && m.backward_input > 0 && m.backward_weight > 0;
    const double f = factor(m.forward, p.forward);
    const double whole = factor(m.backward_input + m.backward_weight, p.backward_input + p.backward_weight);
    const double i = apart ? factor(m.backward_input, p.backward_input) : whole;
    const double w = apart ? factor(m.backward_weight, p.backward_weight) : whole;
    for (std::size_t l = first; l < first + static_cast<std::size_t>(balance[s]); ++l) {
      layers[l].forward *= f;
      layers[l].backward_input *= i;
      layers[l].backward_weight *= w;
    }
    first += static_cast<std::size_t>(balance[s]);
  }
}

/// The time per message between two workers that makes the simulated step of `plan` with `stages` last
/// `measured_seconds` (the span of a real step's actions, step_span_seconds in timeline.hpp): what the step waited
/// beyond its actions' durations (a message's copy and wake-up, a worker's clock), charged to the messages that
/// cross workers. 0 when the simulation without messages already lasts as long. Found by bisection: the simulated
/// step does not shrink as messages get slower.
inline double fit_send_seconds(const std::vector<std::vector<Action>>& plan, const std::vector<ActionCosts>& stages,
                               double measured_seconds) {
  if (!(simulate_step(plan, stages, 0) < measured_seconds)) return 0;
  double lo = 0, hi = measured_seconds;  // no message can take longer than the whole step
  for (int i = 0; i < 40 && hi - lo > 1e-7; ++i) {
    const double mid = (lo + hi) / 2;
    (simulate_step(plan, stages, mid) < measured_seconds ? lo : hi) = mid;
  }
  return lo;
}

/// Cuts beyond which balance_for_plan searches locally instead of simulating every one.
inline constexpr long kExhaustiveCuts = 20000;

/// The cut of `layers` into plan's stages (`num_stages`, each at least one layer) whose simulated step of `plan` is
/// shortest (see the top of this header for the search). A tie keeps partition_by_cost's cut, else the first found
/// (fewer layers on the first stages). UsageError if there are fewer layers than stages.
inline ScheduleBalance balance_for_plan(const std::vector<ActionCosts>& layers,
                                        const std::vector<std::vector<Action>>& plan, int num_stages,
                                        double send_seconds = 0) {
  const int n = static_cast<int>(layers.size()), S = num_stages;
  if (S < 1 || S > n)
    throw UsageError("cannot cut " + std::to_string(n) + " layers into " + std::to_string(S) + " stages");
  auto simulate = [&](const std::vector<int>& cut) {
    return simulate_step(plan, stage_costs(layers, cut), send_seconds);
  };
  std::vector<double> totals;
  for (auto& l : layers) totals.push_back(l.total());
  ScheduleBalance out;
  out.send_seconds = send_seconds;
  out.balance = partition_by_cost(totals, S);
  out.simulated_seconds = out.partition_seconds = simulate(out.balance);
  auto consider = [&](const std::vector<int>& cut) {
    if (const double t = simulate(cut); t < out.simulated_seconds) out.simulated_seconds = t, out.balance = cut;
  };
  // Cuts: C(n-1, S-1), counted with a cap.
  long cuts = 1;
  for (int k = 1; k < S && cuts <= kExhaustiveCuts; ++k) cuts = cuts * (n - k) / k;
  if (cuts <= kExhaustiveCuts) {
    out.exhaustive = true;
    std::vector<int> cut(S, 1);
    // Every composition of n into S positive parts, in lexicographic order of the first stages' sizes.
    auto each = [&](auto& self, int stage, int left) -> void {
      if (stage == S - 1) {
        cut[stage] = left;
        consider(cut);
        return;
      }
      for (int size = 1; size <= left - (S - 1 - stage); ++size) {
        cut[stage] = size;
        self(self, stage + 1, left - size);
      }
    };
    each(each, 0, n);
    return out;
  }
  for (bool better = true; better;) {
    better = false;
    const double before = out.simulated_seconds;
    const std::vector<int> base = out.balance;
    for (int s = 0; s + 1 < S; ++s)
      for (int d = -3; d <= 3; ++d) {
        if (d == 0) continue;
        std::vector<int> cut = base;  // the cut point after stage s moves by d layers
        cut[s] += d, cut[s + 1] -= d;
        if (cut[s] >= 1 && cut[s + 1] >= 1) consider(cut);
        if (s + 2 < S) {  // stage s + 1 moves by d layers as a whole
          cut = base;
          cut[s] += d, cut[s + 2] -= d;
          if (cut[s] >= 1 && cut[s + 2] >= 1) consider(cut);
        }
      }
    better = out.simulated_seconds < before;
  }
  return out;
}

/// balance_for_plan for `schedule` on `workers` workers with `micro_batches` micro-batches: its stage count is
/// `workers` x `stages_per_worker` (0: min_stages_per_worker(schedule), two for the interleaved and V schedules).
inline ScheduleBalance balance_for_schedule(const std::vector<ActionCosts>& layers, Schedule schedule, int workers,
                                            int micro_batches, int stages_per_worker = 0, double send_seconds = 0) {
  const int v = stages_per_worker > 0 ? stages_per_worker : min_stages_per_worker(schedule);
  return balance_for_plan(layers, make_schedule(schedule, workers, v, micro_batches), workers * v, send_seconds);
}

}  // namespace corpc::pipeline
