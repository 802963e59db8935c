// Graceful shutdown (graceful_shutdown.hpp). Each rank reports, per peer, the user requests it sent and the ones it
// finished handling: counting per pair lets requests to a dead rank drop out instead of unbalancing the sums for ever.
// "Idle" includes the runtime's background scope, so a worker whose background work may still talk to a peer keeps
// that peer up; shutdown() joins the scope afterwards.
#include "rpc/graceful_shutdown.hpp"

#include <cstdio>
#include <tuple>

#include "corpc/rpc/call.hpp"

#include "core/trace_recorder.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc::detail {

namespace {

using RoundResult = ShutdownRounds::Result;

// The round's call, on rank 0.
Future<RoundResult> shutdown_round(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                   std::vector<std::uint64_t> handled_from, bool idle) {
  return runtime_impl(Runtime::get()).graceful->report(round, rank, std::move(sent_to), std::move(handled_from), idle);
}

constexpr std::string_view kRoundName = "corpc::shutdown_round";
const bool g_registered = [] {
  global_registry().add(make_entry<&shutdown_round>(std::string(kRoundName), Execution::io_thread));
  return true;
}();

// The round after the last one, in which workers meet once their trace parts are written.
constexpr std::int64_t kTraceRound = -2;

}  // namespace

GracefulShutdown::GracefulShutdown(ShutdownHost& host, Settings settings, Activity& activity, PeerTable& peers,
                                   TaskScope& background)
    : host_(host), settings_(std::move(settings)), activity_(activity), peers_(peers), background_(background) {}

Future<RoundResult> GracefulShutdown::report(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                             std::vector<std::uint64_t> handled_from, bool idle) {
  auto out = rounds_.report(round, rank, std::move(sent_to), std::move(handled_from), idle);
  check_rounds();
  return out;
}

void GracefulShutdown::check_rounds() {
  std::vector<bool> alive(settings_.world_size);
  const std::string lost = lost_ranks();
  const auto deaths = peers_.deaths();
  for (int k = 0; k < settings_.world_size; ++k) alive[k] = deaths[k].empty();
  rounds_.answer_full_rounds(alive, lost);
}

std::string GracefulShutdown::lost_ranks() const {
  std::string out;
  const auto deaths = peers_.deaths();
  for (int k = 0; k < settings_.world_size; ++k) {
    if (deaths[k].empty() || deaths[k] == kShutDownReason) continue;
    out += (out.empty() ? "" : "; ") +
           ("worker '" + host_.name_of(k) + "' (rank " + std::to_string(k) + "): " + deaths[k]);
  }
  return out;
}

RoundResult GracefulShutdown::ask_round(std::int64_t round, bool idle, std::chrono::milliseconds timeout) {
  using Args = std::tuple<std::int64_t, int, std::vector<std::uint64_t>, std::vector<std::uint64_t>, bool>;
  auto* state = FutureState<RoundResult>::make();
  auto fut = future_of(state);
  OutboundCall call;
  call.dst = 0;
  call.function = kRoundName;
  call.function_is_static = true;
  call.function_id = function_id(kRoundName);
  call.signature = signature_of<Args>();
  call.timeout = timeout;
  call.control = true;
  // A peer we saw die counts zero both ways: rank 0 may know it alive again (a new incarnation rejoined, whose own
  // counts start at zero), and what we exchanged with its predecessor is not owed by it.
  auto sent = activity_.sent_counts();
  auto handled = activity_.handled_counts();
  const auto deaths = peers_.deaths();
  for (size_t k = 0; k < deaths.size(); ++k)
    if (!deaths[k].empty()) sent[k] = handled[k] = 0;
  encode_args<Args>(call.message, 0, round, settings_.rank, std::move(sent), std::move(handled), idle);
  call.complete = &complete_call<RoundResult>;
  call.target = state;
  host_.start_call(std::move(call));
  return std::move(fut).wait();
}

GracefulShutdown::Outcome GracefulShutdown::run() {
  const auto limit =
      settings_.timeout.count() > 0 ? settings_.timeout : std::chrono::milliseconds(std::chrono::hours(24 * 365));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto remaining = [&] {
    return std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  };
  Outcome outcome;
  try {
    ask_round(-1, true, remaining());  // everyone has reached shutdown
    std::optional<RoundResult> previous;
    for (std::int64_t round = 0; std::chrono::steady_clock::now() < deadline; ++round) {
      wait_locally_idle(deadline);
      auto result = ask_round(round, locally_idle(), remaining());
      outcome.lost = std::get<2>(result);
      if (std::get<1>(result) && previous == result) {  // quiet, and nothing moved since the last round
        outcome.quiet = true;
        break;
      }
      previous = result;
    }
  } catch (const RpcError&) {
    // Rank 0 is gone or the deadline passed: close anyway rather than hang.
  }
  if (!outcome.quiet) outcome.lost = lost_ranks();  // what this rank saw itself
  if (trace::enabled()) finish_trace(outcome.quiet);
  return outcome;
}

void GracefulShutdown::finish_trace(bool meet) {
  std::vector<std::string> names;
  for (int r = 0; r < settings_.world_size; ++r) names.push_back(host_.name_of(r));
  if (!trace::detail::write_part(names))
    std::fprintf(stderr, "corpc: worker '%s' could not write %s\n", settings_.worker.c_str(),
                 trace::part_path(trace::detail::path(), settings_.rank).c_str());
  if (meet) {
    try {
      // Bounded: a worker that dies now only delays the merge, which then goes without its part.
      ask_round(kTraceRound, true, std::max(settings_.rpc_timeout, std::chrono::milliseconds(1)));
    } catch (const RpcError&) {}
  }
  if (settings_.rank == 0) trace::detail::merge_parts(settings_.world_size);
}

bool GracefulShutdown::locally_idle() const {
  return activity_.idle([this] { return background_.active() == 0; });
}

bool GracefulShutdown::wait_locally_idle(std::chrono::steady_clock::time_point deadline) {
  // The counters wake the wait themselves (call_done, handler_done); the background scope says when it empties.
  return activity_.wait_idle(
      deadline, [this] { return background_.active() == 0; },
      [this] { on_ready_inline(background_.when_empty(), [this] { activity_.wake(); }); });
}

void GracefulShutdown::join_background() noexcept {
  try {
    background_.stop_and_join().wait();
  } catch (...) {
    // Joined twice, or from an I/O thread (a usage error reported elsewhere): nothing more to wait for here.
  }
}

}  // namespace corpc::detail
