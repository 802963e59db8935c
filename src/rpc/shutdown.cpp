// Graceful shutdown's termination detection, run on rank 0: each rank reports, per peer, the user requests it sent
// and the ones it finished handling; the world is quiet when every live pair balances and everyone is idle, twice in
// a row. Counting per pair lets requests to a dead rank drop out instead of unbalancing the sums for ever. The
// rounds themselves travel as control calls (kFlagControl), which are not counted. "Idle" includes the runtime's
// background scope (library work nobody awaits: RRef control messages, values being created), so a worker whose
// background work may still talk to a peer keeps that peer up; shutdown() joins the scope afterwards.
// Each round's answer also carries rank 0's account of the ranks the job lost (died, or left after an error): every
// rank learns that the job failed, including one that never talked to the lost rank itself.
#include <cstdio>
#include <tuple>

#include "corpc/rpc/call.hpp"

#include "core/trace_recorder.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc {

namespace {

// (requests between live ranks, balanced and idle, the ranks the job lost in words: "" if none)
using RoundResult = detail::ShutdownRounds::Result;

Future<RoundResult> shutdown_round(std::int64_t round, int rank, std::vector<std::uint64_t> sent_to,
                                   std::vector<std::uint64_t> handled_from, bool idle) {
  auto& impl = runtime_impl(Runtime::get());
  auto out = impl.shutdown_rounds.report(round, rank, std::move(sent_to), std::move(handled_from), idle);
  impl.check_rounds();
  return out;
}

constexpr std::string_view kRoundName = "corpc::shutdown_round";
const bool g_registered = [] {
  detail::global_registry().add(detail::make_entry<&shutdown_round>(std::string(kRoundName), Execution::io_thread));
  return true;
}();

// Reports this worker's counts for `round` to rank 0 and waits for the round's outcome.
RoundResult ask_round(Runtime::Impl& impl, std::int64_t round, bool idle, std::chrono::milliseconds timeout) {
  using Args = std::tuple<std::int64_t, int, std::vector<std::uint64_t>, std::vector<std::uint64_t>, bool>;
  auto* state = detail::FutureState<RoundResult>::make();
  auto fut = detail::future_of(state);
  detail::OutboundCall call;
  call.dst = 0;
  call.function = kRoundName;
  call.function_is_static = true;
  call.function_id = function_id(kRoundName);
  call.signature = detail::signature_of<Args>();
  call.timeout = timeout;
  call.control = true;
  // A peer we saw die counts zero both ways: rank 0 may know it alive again (a new incarnation rejoined, whose own
  // counts start at zero), and what we exchanged with its predecessor is not owed by it.
  auto sent = impl.activity->sent_counts();
  auto handled = impl.activity->handled_counts();
  const auto deaths = impl.peers->deaths();
  for (size_t k = 0; k < deaths.size(); ++k)
    if (!deaths[k].empty()) sent[k] = handled[k] = 0;
  detail::encode_args<Args>(call.message, 0, round, impl.self.rank, std::move(sent), std::move(handled), idle);
  call.complete = &detail::complete_call<RoundResult>;
  call.target = state;
  detail::start_call(impl, std::move(call));
  return std::move(fut).wait();
}

// The round after the last one, in which workers meet once their trace parts are written.
constexpr std::int64_t kTraceRound = -2;

}  // namespace

void Runtime::Impl::check_rounds() {
  std::vector<bool> alive(world_size);
  const std::string lost = lost_ranks();
  const auto deaths = peers->deaths();
  for (int k = 0; k < world_size; ++k) alive[k] = deaths[k].empty();
  shutdown_rounds.answer_full_rounds(alive, lost);
}

void Runtime::Impl::fail_pending_rounds() { shutdown_rounds.close(); }

std::string Runtime::Impl::lost_ranks() {
  std::string out;
  const auto deaths = peers->deaths();
  for (int k = 0; k < world_size; ++k) {
    if (deaths[k].empty() || deaths[k] == kShutDownReason) continue;
    out += (out.empty() ? "" : "; ") + ("worker '" + name_of(k) + "' (rank " + std::to_string(k) + "): " + deaths[k]);
  }
  return out;
}

Runtime::Impl::ShutdownOutcome Runtime::Impl::graceful_shutdown() {
  const auto limit = options.shutdown_timeout.count() > 0 ? options.shutdown_timeout
                                                          : std::chrono::milliseconds(std::chrono::hours(24 * 365));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto remaining = [&] {
    return std::max<std::chrono::milliseconds>(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  };
  ShutdownOutcome outcome;
  try {
    ask_round(*this, -1, true, remaining());  // everyone has reached shutdown
    std::optional<RoundResult> previous;
    for (std::int64_t round = 0; std::chrono::steady_clock::now() < deadline; ++round) {
      wait_locally_idle(deadline);
      auto result = ask_round(*this, round, locally_idle(), remaining());
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

void Runtime::Impl::finish_trace(bool meet) {
  std::vector<std::string> names;
  for (int r = 0; r < world_size; ++r) names.push_back(name_of(r));
  if (!trace::detail::write_part(names))
    std::fprintf(stderr, "corpc: worker '%s' could not write %s\n", self.name.c_str(),
                 trace::part_path(trace::detail::path(), self.rank).c_str());
  if (meet) {
    try {
      // Bounded: a worker that dies now only delays the merge, which then goes without its part.
      ask_round(*this, kTraceRound, true, std::max(options.rpc_timeout, std::chrono::milliseconds(1)));
    } catch (const RpcError&) {}
  }
  if (self.rank == 0) trace::detail::merge_parts(world_size);
}

bool Runtime::Impl::wait_locally_idle(std::chrono::steady_clock::time_point deadline) {
  // The counters wake the wait themselves (call_done, handler_done); the background scope says when it empties.
  return activity->wait_idle(
      deadline, [this] { return background.active() == 0; },
      [this] { detail::on_ready_inline(background.when_empty(), [this] { activity->wake(); }); });
}

void Runtime::Impl::join_background() noexcept {
  try {
    background.stop_and_join().wait();
  } catch (...) {
    // Joined twice, or from an I/O thread (a usage error reported elsewhere): nothing more to wait for here.
  }
}

}  // namespace corpc
