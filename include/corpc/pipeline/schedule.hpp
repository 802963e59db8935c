/// @file
/// Pipeline schedules as per-worker ordered lists of actions (no torch here).
///
/// The model of torch.distributed.pipelining: every worker runs its own list of actions over micro-batches, in order;
/// an action waits for what it consumes (a forward for the activation from the stage before, a backward for the
/// gradient from the stage after), computes, and sends what it produces. The order alone decides the schedule.
///
/// Notation: K workers, v stages per worker (virtual stages; N = K v stages), M micro-batches per step, worker r in
/// 0..K-1. Placement: in a loop, stage s is on worker s mod K; in a V (v = 2), worker r holds stages r and 2K-1-r.
/// Times per micro-batch and stage: F forward, B backward (B = I + W for zero bubble: I the gradient for the stage's
/// input, W the gradient for its weights). "Held" = micro-batches whose activations a worker keeps (from a forward to
/// the end of its backward), in whole-worker units (a stage of a worker with v stages counts 1/v).
///
/// | schedule        | per worker, in order                                       | bubble fraction (F = I = W, B = 2F) | peak held on worker r          |
/// |-----------------|------------------------------------------------------------|-------------------------------------|--------------------------------|
/// | GPipe           | F0..F(M-1), then B0..B(M-1)                                 | (K-1)/(M+K-1)                       | M                              |
/// | 1F1B            | K-1-r forwards, then F,B alternating, then the last Bs      | (K-1)/(M+K-1)                       | min(M, K-r)                    |
/// | Interleaved1F1B | Megatron's order over v chunks, micro-batches in rounds of K | (K-1)/(vM+K-1)                      | min(vM, 2(K-r-1)+(v-1)K+1)/v   |
/// | ZeroBubbleH1    | 1F1B's Fs and Is; a W wherever the next F or I would wait  | 2(K-1)/(3M+2(K-1))                  | min(M, K-r)                    |
/// |                 | (never holding more than 1F1B), the remaining Ws at the end |                                     |                                |
/// | LoopedBFS       | every micro-batch's F through each of its stages in turn,   | (K-1)/(vM+K-1)                      | M                              |
/// |                 | then every B, last stage first (loop)                       |                                     |                                |
/// | InterleavedZB   | list-scheduled (below) with I and W split (loop)            | run with unit times: K=2: 0.040     | counted: K=2, M=8: 2.5 / 2     |
/// |                 |                                                             | at M=4, 0.020 at M=8; K=4: 0.111,   | (Interleaved1F1B's); K=4: 5.5-4|
/// |                 |                                                             | 0.077                               |                                |
/// | ZBVZeroBubble   | list-scheduled with I and W split (V)                       | K=2: 0.040 at M=4, 0.020 at M=8;    | min(M, K) (as 1F1B's worker 0) |
/// |                 |                                                             | K=4: 0.111, 0.059                   |                                |
/// | DualPipeV       | list-scheduled with whole Bs, each after a forward of the   | K=2: 0.111 at M=4, 0.094 at M=8;    | at most K+1 (DualPipe's)       |
/// |                 | other stage paired into one overlapped action; I and W     | K=4: 0.172, 0.158                   |                                |
/// |                 | once the worker's forwards are done (V)                     |                                     |                                |
///
/// GPipe and 1F1B have the same bubble; 1F1B bounds memory (a stage frees a micro-batch as its backward ends).
/// Interleaving divides the bubble by v at the price of v times the messages; LoopedBFS does too, breadth first, at
/// GPipe's memory. Zero bubble sends I's result upstream at once, so the backward's critical path carries only I,
/// and W fills the waits (ZB-H1, ZB-V: Qi et al., "Zero Bubble Pipeline Parallelism", 2023). The paper's ZB-H1
/// reaches a bubble of (K-1)(F+I-W) by counting what a micro-batch keeps for W alone as less memory; here a
/// micro-batch stays held until its W, so the memory bound of 1F1B leaves (K-1)(F+I): two thirds of 1F1B's bubble
/// with uniform times. The V placement puts the first and the last stage on one worker, so the forward turns into
/// the backward where it ended, without a transfer; with zero bubble's W filling the rest, ZBV's bubble at K = 2 is
/// a fifth of 1F1B's at the same memory. DualPipeV (DeepSeek's DualPipe, cut to one direction) pairs a forward of one
/// micro-batch with a backward of another: on a GPU the two overlap compute with communication; here the pair runs in
/// whichever order its inputs arrive.
///
/// List-scheduled orders (InterleavedZB, ZBVZeroBubble, DualPipeV) are found by running the step with unit times: at
/// every free moment a worker takes a backward whose gradient has arrived, else a forward whose activation has (the
/// deepest stage first), else a pending W, and starts a micro-batch on its first stage only while fewer than a
/// bound are held there (detail::first_stage_caps). Their bubble_formula and peak_held_formula are that run's.
#pragma once

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

#include "corpc/pipeline/action.hpp"
#include "corpc/pipeline/detail/schedule_builders.hpp"
#include "corpc/rpc/errors.hpp"

namespace corpc::pipeline {

/// A pipeline step failed: a stage's worker died or threw, or the step was aborted because another stage failed. The
/// message names the stage and the worker where it began.
class PipelineError : public RpcError {
 public:
  using RpcError::RpcError;
};

/// The pipeline schedules of the table in corpc/pipeline/schedule.hpp. GPipe, 1F1B and ZB-H1 run one stage per
/// worker; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble v >= 2 stages per worker placed in a loop (stage s on
/// worker s mod K); ZBVZeroBubble and DualPipeV two stages per worker placed in a V (worker r holds stages r and
/// 2K-1-r).
enum class Schedule : std::uint8_t {
  GPipe,
  OneFOneB,
  Interleaved1F1B,
  ZeroBubbleH1,
  LoopedBFS,
  InterleavedZeroBubble,
  ZBVZeroBubble,
  DualPipeV,
};

/// Every schedule, in the order of the enum (for tables and tests).
inline constexpr Schedule kAllSchedules[] = {Schedule::GPipe,           Schedule::OneFOneB,
                                             Schedule::Interleaved1F1B, Schedule::ZeroBubbleH1,
                                             Schedule::LoopedBFS,       Schedule::InterleavedZeroBubble,
                                             Schedule::ZBVZeroBubble,   Schedule::DualPipeV};

/// The schedule's name as tables print it ("GPipe", "1F1B", "Interleaved1F1B", "ZB-H1", "LoopedBFS",
/// "InterleavedZB", "ZBV", "DualPipeV").
inline const char* to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe: return "GPipe";
    case Schedule::OneFOneB: return "1F1B";
    case Schedule::Interleaved1F1B: return "Interleaved1F1B";
    case Schedule::ZeroBubbleH1: return "ZB-H1";
    case Schedule::LoopedBFS: return "LoopedBFS";
    case Schedule::InterleavedZeroBubble: return "InterleavedZB";
    case Schedule::ZBVZeroBubble: return "ZBV";
    case Schedule::DualPipeV: return "DualPipeV";
  }
  return "?";
}

/// "gpipe", "1f1b", "interleaved", "zbh1", "loopedbfs", "interleavedzb", "zbv", "dualpipev" (what the benchmark's
/// flags take; the names of to_string() too, in any case); throws UsageError otherwise.
inline Schedule schedule_from_string(std::string name) {
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (name == "gpipe") return Schedule::GPipe;
  if (name == "1f1b") return Schedule::OneFOneB;
  if (name == "interleaved" || name == "interleaved1f1b") return Schedule::Interleaved1F1B;
  if (name == "zbh1" || name == "zb-h1") return Schedule::ZeroBubbleH1;
  if (name == "loopedbfs" || name == "bfs") return Schedule::LoopedBFS;
  if (name == "interleavedzb" || name == "interleavedzerobubble") return Schedule::InterleavedZeroBubble;
  if (name == "zbv" || name == "zbvzerobubble") return Schedule::ZBVZeroBubble;
  if (name == "dualpipev") return Schedule::DualPipeV;
  throw UsageError("unknown pipeline schedule '" + name +
                   "' (gpipe, 1f1b, interleaved, zbh1, loopedbfs, interleavedzb, zbv, dualpipev)");
}

/// How a schedule places stages on workers: in a loop (stage s on worker s mod K) or in a V (worker r holds stages r
/// and 2K-1-r, so that the first and the last stage share a worker and the loss turns around where it is computed).
enum class Placement : std::uint8_t { loop, v };

/// The placement `schedule` is made for.
inline Placement placement_of(Schedule schedule) {
  return schedule == Schedule::ZBVZeroBubble || schedule == Schedule::DualPipeV ? Placement::v : Placement::loop;
}

/// The worker (0..K-1) of each of `stages` stages on `workers` workers placed as `p` (V: stages == 2 workers).
inline std::vector<int> stage_workers(Placement p, int workers, int stages) {
  if (workers < 1 || stages < workers || stages % workers != 0)
    throw UsageError("a pipeline needs a whole number of stages per worker: " + std::to_string(stages) + " stages on " +
                     std::to_string(workers) + " workers");
  if (p == Placement::v && stages != 2 * workers)
    throw UsageError("a V placement needs exactly two stages per worker: " + std::to_string(stages) + " stages on " +
                     std::to_string(workers) + " workers");
  std::vector<int> out(stages);
  for (int s = 0; s < stages; ++s) out[s] = p == Placement::v && s >= workers ? 2 * workers - 1 - s : s % workers;
  return out;
}

/// The fewest stages per worker `schedule` runs: 1 for GPipe, 1F1B and ZB-H1 (which run exactly one), 2 for the
/// others (ZBV and DualPipeV run exactly two).
inline int min_stages_per_worker(Schedule schedule) {
  return schedule == Schedule::GPipe || schedule == Schedule::OneFOneB || schedule == Schedule::ZeroBubbleH1 ? 1 : 2;
}

namespace detail {
// The memory bounds the list-scheduled orders run under (see list_schedule): micro-batches worker r may hold on its
// first stage. Chosen with the unit-time simulation over K = 2, 4, 8 and M = 1..16 as the smallest bound past which
// the bubble stops shrinking: ZBV K (the ZB-V paper's memory, that of 1F1B), DualPipeV K + 1 (DualPipe's K + 1
// chunks' worth), interleaved zero bubble K + v - 1 - r (Interleaved1F1B's warm-up on the first chunk), 2 more from
// K = 4 on, where the loop's longer round trip needs them.
inline std::vector<int> first_stage_caps(Schedule schedule, int K, int v) {
  std::vector<int> caps(K);
  for (int r = 0; r < K; ++r)
    caps[r] = schedule == Schedule::InterleavedZeroBubble ? K + v - 1 - r + (K >= 4 ? 2 : 0)
              : schedule == Schedule::DualPipeV           ? K + 1
                                                          : K;
  return caps;
}
}  // namespace detail

/// The action lists of one step: plan[r] is worker r's, for `workers` workers, `stages_per_worker` (v) stages each
/// and `micro_batches` (M), the stages placed as placement_of(schedule) says. GPipe, 1F1B and ZB-H1 need v == 1,
/// ZBVZeroBubble and DualPipeV v == 2, the others v >= 2 (UsageError otherwise).
inline std::vector<std::vector<Action>> make_schedule(Schedule schedule, int workers, int stages_per_worker,
                                                      int micro_batches) {
  const int K = workers, v = stages_per_worker, M = micro_batches;
  if (K < 1 || M < 1 || v < 1) throw UsageError("a schedule needs at least one worker, stage and micro-batch");
  const bool one = min_stages_per_worker(schedule) == 1;
  const bool two = placement_of(schedule) == Placement::v;
  if (one && v != 1) throw UsageError(std::string(to_string(schedule)) + " runs one stage per worker");
  if (two && v != 2) throw UsageError(std::string(to_string(schedule)) + " runs two stages per worker (a V)");
  if (!one && !two && v < 2)
    throw UsageError(std::string(to_string(schedule)) + " needs at least two stages per worker");
  const int S = K * v;
  switch (schedule) {
    case Schedule::ZeroBubbleH1: return detail::zero_bubble_h1(K, M);
    case Schedule::InterleavedZeroBubble:
    case Schedule::ZBVZeroBubble:
    case Schedule::DualPipeV: {
      const bool zero_bubble = schedule != Schedule::DualPipeV;
      auto plan =
          detail::list_schedule(K, S, M, stage_workers(placement_of(schedule), K, S),
                                zero_bubble ? detail::SplitBackward::always : detail::SplitBackward::once_forwards_end,
                                detail::first_stage_caps(schedule, K, v));
      if (!zero_bubble) detail::pair_forward_backward(plan);
      return plan;
    }
    default: break;
  }
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
      case Schedule::LoopedBFS:  // breadth first: every micro-batch through one stage, then the next stage
        for (int c = 0; c < v; ++c)
          for (int m = 0; m < M; ++m) add(ActionKind::Forward, c * K + r, m);
        for (int c = v - 1; c >= 0; --c)
          for (int m = 0; m < M; ++m) add(ActionKind::Backward, c * K + r, m);
        break;
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
      default: break;
    }
  }
  return plan;
}

/// Executes `plan` with unit-time actions (F = I = W = 1, B = 2) and every worker waiting for its inputs as the real
/// runtime does: an overlapped pair starts with its backward when only the backward's input is there. Returns the
/// makespan. Throws UsageError if the plan deadlocks, names a stage or micro-batch out of range, runs a backward
/// before its forward on a worker, or misses a backward. Checks a schedule before it runs (a deadlocked order would
/// otherwise hang the step), and gives the bubble it should show.
inline double simulate_schedule(std::vector<std::vector<Action>> plan, int num_stages, int micro_batches) {
  const int K = static_cast<int>(plan.size()), S = num_stages, M = micro_batches;
  // done_*[stage][micro]: time the result is available; -1 while not done.
  std::vector<std::vector<double>> fwd(S, std::vector<double>(M, -1)), grad(S, std::vector<double>(M, -1));
  std::vector<std::size_t> next(K, 0);
  std::vector<double> clock(K, 0);
  std::size_t remaining = 0;
  for (auto& p : plan) remaining += p.size();
  for (auto& p : plan)
    for (auto& a : p)
      if (a.stage < 0 || a.stage >= S || a.micro < 0 || a.micro >= M) throw UsageError("action out of range");
  // When the input of `a` is available; -1 while it is not.
  auto input_at = [&](const Action& a) -> double {
    if (a.kind == ActionKind::Forward) return a.stage > 0 ? fwd[a.stage - 1][a.micro] : 0;
    if (a.kind == ActionKind::BackwardWeight) return 0;
    if (fwd[a.stage][a.micro] < 0) throw UsageError("backward before forward on one worker");
    return a.stage + 1 < S ? grad[a.stage + 1][a.micro] : 0;
  };
  while (remaining) {
    bool progressed = false;
    for (int r = 0; r < K; ++r) {
      while (next[r] < plan[r].size()) {
        auto& list = plan[r];
        const std::size_t i = next[r];
        if (list[i].overlap && i + 1 < list.size() && input_at(list[i]) < 0 && input_at(list[i + 1]) >= 0) {
          std::swap(list[i], list[i + 1]);
          list[i + 1].overlap = false;
        }
        const Action& a = list[i];
        const double ready = input_at(a);
        if (ready < 0) break;
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

/// Peak micro-batches each worker of `plan` holds, counted in stages' activations (a forward takes one, the
/// backward that ends its micro-batch on that stage gives it back: B, or W after I).
inline std::vector<int> count_peak_held(const std::vector<std::vector<Action>>& plan) {
  std::vector<int> peaks;
  for (auto& list : plan) {
    int held = 0, peak = 0;
    for (auto& a : list) {
      if (a.kind == ActionKind::Forward) peak = std::max(peak, ++held);
      else if (a.kind != ActionKind::BackwardInput) --held;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

/// M of a schedule given as data: the highest micro-batch index in it, plus one (0 for an empty one).
inline int schedule_micro_batches(const std::vector<std::vector<Action>>& plan) {
  int m = -1;
  for (auto& list : plan)
    for (auto& a : list) m = std::max(m, static_cast<int>(a.micro));
  return m + 1;
}

/// Checks a schedule given as data (custom_actions, read_schedule_csv) for `num_stages` stages before it runs, and
/// returns the worker of each stage (where its actions are). UsageError, naming the action, if a stage has actions
/// on two workers or none; a (stage, micro-batch) lacks its forward or its backward (B, or I followed by W on the
/// same worker) or has one twice; an overlapped forward is not followed by a backward; the order deadlocks
/// (simulate_schedule); or, when `max_held` > 0, a worker holds more than max_held micro-batches (count_peak_held).
inline std::vector<int> check_schedule(const std::vector<std::vector<Action>>& plan, int num_stages, int max_held = 0) {
  const int S = num_stages, M = schedule_micro_batches(plan);
  if (S < 1 || M < 1) throw UsageError("a pipeline schedule needs at least one stage and one micro-batch");
  auto name = [](const Action& a) { return std::to_string(a.stage) + action_letter(a.kind) + std::to_string(a.micro); };
  std::vector<int> worker(S, -1);
  // per (stage, micro): forwards, whole backwards, Is, Ws seen
  std::vector<std::vector<std::array<int, 4>>> seen(S, std::vector<std::array<int, 4>>(M, {0, 0, 0, 0}));
  for (std::size_t r = 0; r < plan.size(); ++r) {
    for (std::size_t i = 0; i < plan[r].size(); ++i) {
      const Action& a = plan[r][i];
      if (a.stage < 0 || a.stage >= S || a.micro < 0)
        throw UsageError("schedule action " + name(a) + " names a stage outside 0.." + std::to_string(S - 1));
      if (worker[a.stage] >= 0 && worker[a.stage] != static_cast<int>(r))
        throw UsageError("schedule puts stage " + std::to_string(a.stage) + " on two workers (" +
                         std::to_string(worker[a.stage]) + " and " + std::to_string(r) + ")");
      worker[a.stage] = static_cast<int>(r);
      auto& count = seen[a.stage][a.micro][static_cast<int>(a.kind)];
      if (++count > 1) throw UsageError("schedule runs " + name(a) + " twice");
      if (a.kind == ActionKind::BackwardWeight && !seen[a.stage][a.micro][2])
        throw UsageError("schedule runs " + name(a) + " before its I");
      if (a.overlap && (i + 1 == plan[r].size() || plan[r][i + 1].kind == ActionKind::Forward))
        throw UsageError("schedule overlaps " + name(a) + " with no backward after it");
    }
  }
  for (int s = 0; s < S; ++s) {
    if (worker[s] < 0) throw UsageError("schedule has no action for stage " + std::to_string(s));
    for (int m = 0; m < M; ++m) {
      const auto& c = seen[s][m];
      const std::string at = "stage " + std::to_string(s) + ", micro-batch " + std::to_string(m);
      if (!c[0]) throw UsageError("schedule has no forward for " + at);
      if (c[1] + c[2] != 1) throw UsageError("schedule needs one backward (B or I) for " + at);
      if (c[2] != c[3]) throw UsageError("schedule has an I without its W (or a W without its I) for " + at);
    }
  }
  simulate_schedule(plan, S, M);
  if (max_held > 0) {
    auto peaks = count_peak_held(plan);
    for (std::size_t r = 0; r < peaks.size(); ++r)
      if (peaks[r] > max_held)
        throw UsageError("schedule holds " + std::to_string(peaks[r]) + " micro-batches on worker " +
                         std::to_string(r) + "; the bound is " + std::to_string(max_held));
  }
  return worker;
}

/// The bubble fraction of the table above: idle time over the step's span with uniform stage times (F = I = W, B =
/// 2F). For GPipe, 1F1B, ZB-H1, LoopedBFS and Interleaved1F1B the closed forms of the table (Interleaved1F1B and
/// LoopedBFS with M a multiple of K; otherwise a last shorter round makes it larger); for the list-scheduled orders
/// (InterleavedZB, ZBV, DualPipeV) the order is run with those times, which is exact for them.
inline double bubble_formula(Schedule schedule, int workers, int stages_per_worker, int micro_batches) {
  const double K = workers, v = stages_per_worker, M = micro_batches;
  switch (schedule) {
    case Schedule::Interleaved1F1B:
    case Schedule::LoopedBFS: return (K - 1) / (v * M + K - 1);
    case Schedule::ZeroBubbleH1: return 2 * (K - 1) / (3 * M + 2 * (K - 1));
    case Schedule::GPipe:
    case Schedule::OneFOneB: return (K - 1) / (M + K - 1);
    default: {
      const double span = simulate_schedule(make_schedule(schedule, workers, stages_per_worker, micro_batches),
                                            workers * stages_per_worker, micro_batches);
      return 1.0 - 3.0 * v * M / span;
    }
  }
}

/// Peak micro-batches held by worker r in the table above, in whole-worker units (a stage of a worker with v stages
/// counts 1/v). For the list-scheduled orders, counted from the order (at most first_stage_caps, see the table).
inline double peak_held_formula(Schedule schedule, int workers, int stages_per_worker, int micro_batches, int r) {
  const int K = workers, v = stages_per_worker, M = micro_batches;
  switch (schedule) {
    case Schedule::GPipe:
    case Schedule::LoopedBFS: return M;
    case Schedule::Interleaved1F1B: return std::min(v * M, 2 * (K - r - 1) + (v - 1) * K + 1) / double(v);
    case Schedule::InterleavedZeroBubble:
    case Schedule::ZBVZeroBubble:
    case Schedule::DualPipeV: return count_peak_held(make_schedule(schedule, K, v, M))[r] / double(v);
    default: return std::min(M, K - r);
  }
}

}  // namespace corpc::pipeline
