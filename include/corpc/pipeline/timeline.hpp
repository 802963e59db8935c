/// @file
/// What each worker of a pipeline did in a step, and when (no torch here).
///
/// Every worker stamps each action with the machine's monotonic clock (CLOCK_MONOTONIC is one clock for all the
/// processes of a host, so records from different workers line up; across hosts they would need an offset). From the
/// records: the measured bubble (idle share of the step's span), a Chrome trace (chrome://tracing, Perfetto) with one
/// track per worker, and the rows of a Gantt chart.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "corpc/core/trace.hpp"
#include "corpc/pipeline/schedule.hpp"
#include "corpc/pipeline/schedule_balance.hpp"
#include "corpc/wire/codec.hpp"

namespace corpc::pipeline {

/// When one action ran, on which worker.
struct ActionRecord {
  Action action;              ///< what ran
  std::int32_t rank = -1;     ///< the worker that ran it
  std::int64_t start_ns = 0;  ///< steady_clock, from the action's inputs being there to its outputs being sent
  std::int64_t end_ns = 0;    ///< steady_clock, when its outputs were sent
  CORPC_FIELDS(action, rank, start_ns, end_ns)
};

/// One worker's account of one step.
struct WorkerReport {
  std::int32_t rank = -1;             ///< the worker
  std::vector<std::int32_t> stages;   ///< the stages it hosts
  std::vector<ActionRecord> records;  ///< in the order they ran
  /// Peak over the step of the bytes the CPU allocator had handed out beyond what was live when the step began
  /// (parameters, gradients, optimizer state): the activations a schedule keeps, plus the step's transient buffers.
  std::int64_t peak_activation_bytes = 0;
  std::int32_t peak_micro_batches_held = 0;  ///< most micro-batches whose activations it held at once (all its stages)
  std::vector<double> losses;                ///< last stage only: each micro-batch's loss, scaled by its batch share
  CORPC_FIELDS(rank, stages, records, peak_activation_bytes, peak_micro_batches_held, losses)
};

/// Seconds from the first action's start to the last action's end, over the workers: the part of a step the
/// schedule decides (the master's calls before and the optimizer step after are outside it); 0 for no records.
inline double step_span_seconds(const std::vector<WorkerReport>& workers) {
  std::int64_t first = INT64_MAX, last = INT64_MIN;
  for (auto& w : workers)
    for (auto& r : w.records) first = std::min(first, r.start_ns), last = std::max(last, r.end_ns);
  return last > first ? static_cast<double>(last - first) * 1e-9 : 0;
}

/// Idle share of the step on each worker, averaged: 1 - busy / span, the span running from the first action's start
/// to the last action's end over all workers. The schedule tables' bubble fraction measures the same thing.
inline double measured_bubble(const std::vector<WorkerReport>& workers) {
  const double span = step_span_seconds(workers);
  if (workers.empty() || span <= 0) return 0;
  double idle = 0;
  for (auto& w : workers) {
    std::int64_t busy = 0;
    for (auto& r : w.records) busy += r.end_ns - r.start_ns;
    idle += 1.0 - static_cast<double>(busy) * 1e-9 / span;
  }
  return idle / static_cast<double>(workers.size());
}

/// Seconds each stage spent computing in one step (the sum of its actions' durations; waiting for inputs is not
/// counted): what refine_balance (balance.hpp) compares with a profile. `stages` is the pipeline's number of stages.
inline std::vector<double> stage_busy_seconds(const std::vector<WorkerReport>& workers, int stages) {
  std::vector<double> busy(static_cast<std::size_t>(std::max(stages, 0)), 0.0);
  for (auto& w : workers)
    for (auto& r : w.records)
      if (r.action.stage >= 0 && r.action.stage < stages)
        busy[static_cast<std::size_t>(r.action.stage)] += static_cast<double>(r.end_ns - r.start_ns) * 1e-9;
  return busy;
}

/// Each stage's mean seconds per micro-batch in each kind of action in one step: F; I and W where the schedule ran
/// them apart, else the whole backward (B) in backward_input. What calibrate_layer_costs (schedule_balance.hpp)
/// corrects a profile with, and what simulate_step replays a step with. `stages` is the pipeline's number of stages;
/// a kind a stage did not run is 0.
inline std::vector<ActionCosts> stage_action_costs(const std::vector<WorkerReport>& workers, int stages) {
  const auto n = static_cast<std::size_t>(std::max(stages, 0));
  std::vector<std::array<double, 4>> sum(n, {0, 0, 0, 0});
  std::vector<std::array<int, 4>> count(n, {0, 0, 0, 0});
  for (auto& w : workers)
    for (auto& r : w.records) {
      if (r.action.stage < 0 || r.action.stage >= stages) continue;
      const auto s = static_cast<std::size_t>(r.action.stage), k = static_cast<std::size_t>(r.action.kind);
      sum[s][k] += static_cast<double>(r.end_ns - r.start_ns) * 1e-9;
      ++count[s][k];
    }
  std::vector<ActionCosts> costs(n);
  for (std::size_t s = 0; s < n; ++s) {
    auto mean = [&](ActionKind kind) {
      const auto k = static_cast<std::size_t>(kind);
      return count[s][k] ? sum[s][k] / count[s][k] : 0.0;
    };
    costs[s] = {mean(ActionKind::Forward), mean(ActionKind::Backward) + mean(ActionKind::BackwardInput),
                mean(ActionKind::BackwardWeight)};
  }
  return costs;
}

/// Appends one step's actions to a Chrome trace ("traceEvents" of complete events): pid = `process` (one per
/// schedule), tid = worker rank, times in microseconds from `origin_ns`. `name` labels the process. The events are
/// formatted as the job traces of corpc/core/trace.hpp are, so the two files merge (trace::merge_chrome_traces).
class ChromeTrace {
 public:
  /// Adds the records of `workers` (one step, e.g. StepResult::workers) as a process named `name`.
  void add_step(int process, const std::string& name, const std::vector<WorkerReport>& workers,
                std::int64_t origin_ns) {
    events_.push_back(trace::process_name_event(process, name, process));
    for (auto& w : workers) {
      std::string stages;
      for (auto s : w.stages) {
        if (!stages.empty()) stages += ',';
        stages += std::to_string(s);
      }
      events_.push_back(
          trace::thread_name_event(process, w.rank, "worker" + std::to_string(w.rank) + " (stage " + stages + ")"));
      for (auto& r : w.records) {
        const char letter = action_letter(r.action.kind);
        events_.push_back(trace::ChromeEvent('X', process, w.rank)
                              .name(letter + std::to_string(r.action.micro) + "/s" + std::to_string(r.action.stage))
                              .cat(std::string(1, letter))
                              .ts(static_cast<double>(r.start_ns - origin_ns) / 1000.0)
                              .dur(static_cast<double>(r.end_ns - r.start_ns) / 1000.0)
                              .str());
      }
    }
  }
  /// Writes the trace (every step added so far) to `path` as JSON; false if the file could not be written.
  bool write(const std::string& path) const { return trace::write_chrome_trace(path, events_); }

 private:
  std::vector<std::string> events_;
};

}  // namespace corpc::pipeline
