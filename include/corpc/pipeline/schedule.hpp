/// @file
/// Pipeline schedules as per-worker ordered lists of actions (no torch here).
///
/// The model of torch.distributed.pipelining: every worker runs its own list of actions over micro-batches, in order;
/// an action waits for what it consumes (a forward for the activation from the stage before, a backward for the
/// gradient from the stage after), computes, and sends what it produces. The order alone decides the schedule.
///
/// Notation: K workers, v stages per worker (virtual stages; N = K v stages, stage s on worker s mod K), M
/// micro-batches per step, worker r in 0..K-1. Times per micro-batch and stage: F forward, B backward (B = I + W for
/// zero bubble: I the gradient for the stage's input, W the gradient for its weights). "Held" = micro-batches whose
/// activations a stage keeps (from its forward to the end of its backward), counted in one stage's activations.
///
/// | schedule        | per worker, in order                                      | bubble fraction (uniform F, B)   | peak held on worker r         |
/// |-----------------|-----------------------------------------------------------|----------------------------------|-------------------------------|
/// | GPipe           | F0..F(M-1), then B0..B(M-1)                                | (K-1)/(M+K-1)                    | M                             |
/// | 1F1B            | K-1-r forwards, then F,B alternating, then the last Bs     | (K-1)/(M+K-1)                    | min(M, K-r)                   |
/// | Interleaved1F1B | Megatron's order over v chunks, micro-batches in rounds of K| (K-1)/(vM+K-1)                   | min(vM, 2(K-r-1)+(v-1)K+1)/v  |
/// | ZeroBubbleH1    | 1F1B's Fs and Is; a W wherever the next F or I would wait | 2(K-1)/(3M+2(K-1)) if F = I = W  | min(M, K-r)                   |
/// |                 | (never holding more than 1F1B), the remaining Ws at the end|  (1F1B: 3(K-1)/(3M+3(K-1)))     |                               |
///
/// GPipe and 1F1B have the same bubble; 1F1B bounds memory (a stage frees a micro-batch as its backward ends).
/// Interleaving divides the bubble by v at the price of v times the messages. Zero bubble sends I's result upstream at
/// once, so the backward's critical path carries only I, and W fills the waits (ZB-H1: Qi et al., "Zero Bubble
/// Pipeline Parallelism", 2023). The paper's ZB-H1 reaches a bubble of (K-1)(F+I-W) by counting what a micro-batch
/// keeps for W alone as less memory; here a micro-batch stays held until its W, so the memory bound of 1F1B leaves
/// (K-1)(F+I): two thirds of 1F1B's bubble with uniform times. The peak for Interleaved1F1B is in units of a whole worker's activations per
/// micro-batch (a chunk holds 1/v of the worker's layers).
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "corpc/rpc/errors.hpp"
#include "corpc/wire/codec.hpp"

namespace corpc::pipeline {

/// A pipeline step failed: a stage's worker died or threw, or the step was aborted because another stage failed. The
/// message names the stage and the worker where it began.
class PipelineError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// The pipeline schedules of the table in corpc/pipeline/schedule.hpp: GPipe, 1F1B, interleaved 1F1B (Megatron-LM's,
/// v >= 2 stages per worker) and zero bubble (ZB-H1).
enum class Schedule : std::uint8_t { GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1 };

/// The schedule's name as tables print it ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1").
inline const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "GPipe";
    case Schedule::OneFOneB: return "1F1B";
    case Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case Schedule::ZeroBubbleH1: return "ZB-H1";
  }
  return "?";
}

/// "gpipe", "1f1b", "interleaved", "zbh1" (what the benchmark's flags take); throws UsageError otherwise.
inline Schedule schedule_from_string(const std::string& name) {
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  if (name == "interleaved" || name == "interleaved1f1b") return Schedule::Interleaved1F1B;
  if (name == "zbh1" || name == "zb-h1") return Schedule::ZeroBubbleH1;
  throw UsageError("unknown pipeline schedule '" + name + "' (gpipe, 1f1b, interleaved, zbh1)");
}

/// Forward; Backward (input and weights together); BackwardInput and BackwardWeight (zero bubble).
enum class ActionKind : std::uint8_t { Forward, Backward, BackwardInput, BackwardWeight };

/// 'F', 'B', 'I' or 'W', as timelines label actions.
inline char action_letter(ActionKind k) {
  switch (k) {
    case ActionKind::Forward: return 'F';
    case ActionKind::Backward: return 'B';
    case ActionKind::BackwardInput: return 'I';
    case ActionKind::BackwardWeight: return 'W';
  }
  return '?';
}

/// One step of a worker's action list: compute `kind` for micro-batch `micro` on stage `stage`.
struct Action {
  ActionKind kind = ActionKind::Forward;           ///< what to compute
  std::int32_t stage = 0;                          ///< global stage index
  std::int32_t micro = 0;                          ///< micro-batch index
  bool operator==(const Action&) const = default;  ///< field by field
  CORPC_FIELDS(kind, stage, micro)
};

namespace detail {
// ZB-H1's order: each worker runs 1F1B's forwards and input-backwards (I) in 1F1B's order, and a pending W whenever
// that next action would have to wait (or a forward would hold more micro-batches than 1F1B does); the Ws left at
// the end run last. The order is found by running it with unit times (F = I = W), which is the case ZB-H1 is
// designed for; with other times it stays a valid order, only the bubble differs.
inline std::vector<std::vector<Action>> zero_bubble_h1(int K, int M) {
  std::vector<std::vector<Action>> main(K), plan(K);
  for (int r = 0; r < K; ++r) {
    const int warm = std::min(K - 1 - r, M);
    for (int m = 0; m < warm; ++m) main[r].push_back(Action{ActionKind::Forward, r, m});
    for (int m = 0; m < M; ++m) {
      if (warm + m < M) main[r].push_back(Action{ActionKind::Forward, r, warm + m});
      main[r].push_back(Action{ActionKind::BackwardInput, r, m});
    }
  }
  const long kNever = -1;
  std::vector<std::vector<long>> fwd(K, std::vector<long>(M, kNever)), grad(K, std::vector<long>(M, kNever));
  std::vector<std::size_t> next(K, 0);
  std::vector<std::deque<int>> pending_w(K);
  std::vector<int> held(K, 0);
  auto done_by = [&](long at, long t) { return at != kNever && at <= t; };
  for (long t = 0;; ++t) {
    bool busy = false;
    std::vector<std::pair<int, Action>> finished;  // visible to others from t + 1
    for (int r = 0; r < K; ++r) {
      if (next[r] < main[r].size()) {
        busy = true;
        const Action& a = main[r][next[r]];
        const bool ready = a.kind == ActionKind::Forward ? (r == 0 || done_by(fwd[r - 1][a.micro], t))
                                                         : (r == K - 1 || done_by(grad[r + 1][a.micro], t));
        const bool room = a.kind != ActionKind::Forward || held[r] < K - r;
        if (ready && room) {
          plan[r].push_back(a);
          finished.emplace_back(r, a);
          if (a.kind == ActionKind::Forward) ++held[r];
          else pending_w[r].push_back(a.micro);
          ++next[r];
          continue;
        }
      }
      if (!pending_w[r].empty() && next[r] < main[r].size()) {
        plan[r].push_back(Action{ActionKind::BackwardWeight, r, pending_w[r].front()});
        pending_w[r].pop_front();
        --held[r];
      }
    }
    for (auto& [r, a] : finished) (a.kind == ActionKind::Forward ? fwd : grad)[r][a.micro] = t + 1;
    if (!busy) break;
  }
  for (int r = 0; r < K; ++r)
    for (int m : pending_w[r]) plan[r].push_back(Action{ActionKind::BackwardWeight, r, m});
  return plan;
}
}  // namespace detail

/// The action lists of one step: plan[r] is worker r's, for `workers` workers, `stages_per_worker` (v) stages each
/// and `micro_batches` (M). Interleaved1F1B needs v >= 2, the others v == 1 (UsageError otherwise).
inline std::vector<std::vector<Action>> make_schedule(Schedule schedule, int workers, int stages_per_worker,
                                                      int micro_batches) {
  const int K = workers, v = stages_per_worker, M = micro_batches;
  if (K < 1 || M < 1 || v < 1) throw UsageError("a schedule needs at least one worker, stage and micro-batch");
  if ((schedule == Schedule::Interleaved1F1B) != (v > 1))
    throw UsageError(std::string(to_string(schedule)) +
                     (v > 1 ? " runs one stage per worker" : " needs at least two stages per worker"));
  std::vector<std::vector<Action>> plan(K);
  for (int r = 0; r < K; ++r) {
    auto& out = plan[r];
    auto add = [&](ActionKind k, int stage, int micro) { out.push_back(Action{k, stage, micro}); };
    switch (schedule) {
      case Schedule::GPipe:
        for (int m = 0; m < M; ++m) add(ActionKind::Forward, r, m);
        for (int m = 0; m < M; ++m) add(ActionKind::Backward, r, m);
        break;
      case Schedule::OneFOneB: {
        const int warm = std::min(K - 1 - r, M);
        for (int m = 0; m < warm; ++m) add(ActionKind::Forward, r, m);
        for (int m = 0; m < M; ++m) {
          if (warm + m < M) add(ActionKind::Forward, r, warm + m);
          add(ActionKind::Backward, r, m);
        }
        break;
      }
      case Schedule::ZeroBubbleH1: break;  // built for all workers at once below
      case Schedule::Interleaved1F1B: {
        // Megatron-LM's order: micro-batches in rounds of K (the last round may be shorter); within a round, every
        // chunk in turn (forward: first chunk first; backward: last chunk first).
        std::vector<std::pair<int, int>> fwd, bwd;  // (chunk, micro)
        for (int start = 0; start < M; start += K) {
          const int end = std::min(start + K, M);
          for (int c = 0; c < v; ++c)
            for (int m = start; m < end; ++m) fwd.emplace_back(c, m);
          for (int c = v - 1; c >= 0; --c)
            for (int m = start; m < end; ++m) bwd.emplace_back(c, m);
        }
        const int total = v * M;
        const int warm = std::min(2 * (K - r - 1) + (v - 1) * K, total);
        for (int i = 0; i < warm; ++i) add(ActionKind::Forward, fwd[i].first * K + r, fwd[i].second);
        for (int i = 0; i < total; ++i) {
          if (warm + i < total) add(ActionKind::Forward, fwd[warm + i].first * K + r, fwd[warm + i].second);
          add(ActionKind::Backward, bwd[i].first * K + r, bwd[i].second);
        }
        break;
      }
    }
  }
  if (schedule == Schedule::ZeroBubbleH1) plan = detail::zero_bubble_h1(K, M);
  return plan;
}

/// The bubble fraction of the table above (idle time over the step's span, uniform stage times; ZB-H1 with F = I = W;
/// Interleaved1F1B with M a multiple of K, otherwise its last round is shorter and the bubble larger).
inline double bubble_formula(Schedule schedule, int workers, int stages_per_worker, int micro_batches) {
  const double K = workers, v = stages_per_worker, M = micro_batches;
  switch (schedule) {
    case Schedule::Interleaved1F1B: return (K - 1) / (v * M + K - 1);
    case Schedule::ZeroBubbleH1: return 2 * (K - 1) / (3 * M + 2 * (K - 1));
    default: return (K - 1) / (M + K - 1);
  }
}

/// Peak micro-batches held by worker r in the table above (for Interleaved1F1B, in whole-worker units).
inline double peak_held_formula(Schedule schedule, int workers, int stages_per_worker, int micro_batches, int r) {
  const int K = workers, v = stages_per_worker, M = micro_batches;
  switch (schedule) {
    case Schedule::GPipe: return M;
    case Schedule::Interleaved1F1B: return std::min(v * M, 2 * (K - r - 1) + (v - 1) * K + 1) / double(v);
    default: return std::min(M, K - r);
  }
}

/// Executes `plan` with unit-time actions (F = B/2 = I = W = 1, B = 2) and every worker waiting for its inputs as the
/// real runtime does. Returns the makespan; throws std::logic_error if the plan deadlocks or misses an action. Checks a
/// schedule before it runs (a deadlocked order would otherwise hang the step), and gives the bubble it should show.
inline double simulate_schedule(const std::vector<std::vector<Action>>& plan, int num_stages, int micro_batches) {
  const int K = static_cast<int>(plan.size()), S = num_stages, M = micro_batches;
  // done_*[stage][micro]: time the result is available; -1 while not done.
  std::vector<std::vector<double>> fwd(S, std::vector<double>(M, -1)), grad(S, std::vector<double>(M, -1));
  std::vector<std::size_t> next(K, 0);
  std::vector<double> clock(K, 0);
  std::size_t remaining = 0;
  for (auto& p : plan) remaining += p.size();
  while (remaining) {
    bool progressed = false;
    for (int r = 0; r < K; ++r) {
      while (next[r] < plan[r].size()) {
        const Action& a = plan[r][next[r]];
        if (a.stage < 0 || a.stage >= S || a.micro < 0 || a.micro >= M) throw UsageError("action out of range");
        double ready = 0;
        if (a.kind == ActionKind::Forward) {
          if (a.stage > 0 && (ready = fwd[a.stage - 1][a.micro]) < 0) break;
        } else if (a.kind != ActionKind::BackwardWeight) {
          if (fwd[a.stage][a.micro] < 0) throw UsageError("backward before forward on one worker");
          if (a.stage + 1 < S && (ready = grad[a.stage + 1][a.micro]) < 0) break;
        }
        const double cost = a.kind == ActionKind::Backward ? 2 : 1;
        clock[r] = std::max(clock[r], ready) + cost;
        if (a.kind == ActionKind::Forward) fwd[a.stage][a.micro] = clock[r];
        else if (a.kind != ActionKind::BackwardWeight) grad[a.stage][a.micro] = clock[r];
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed && remaining) throw UsageError("pipeline schedule deadlocks");
  }
  for (auto& g : grad)
    for (double t : g)
      if (t < 0) throw UsageError("pipeline schedule misses a backward");
  return *std::max_element(clock.begin(), clock.end());
}

}  // namespace corpc::pipeline
