// The runtime's side of outgoing calls: start_call picks the connection to the callee and hands the call to that
// connection's call engine (call_engine.hpp); replies go to that engine (route_replies).
#include "corpc/rpc/detail/outbound.hpp"

#include "rpc/call_engine.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc {

namespace detail {

void start_call(Runtime& runtime, OutboundCall&& call) noexcept { start_call(runtime_impl(runtime), std::move(call)); }

namespace {

// A call to a rank that died, held until a new incarnation takes the rank (RpcOptions::replacement_wait), if the rank
// may come back: not one that said goodbye (shut down, or stopped after an error it named). False: the rank is alive,
// or not to be waited for; the call goes on.
bool hold_for_replacement(Runtime::Impl& rt, OutboundCall& call) {
  const int dst = call.dst;
  const std::string why = rt.peers->death(dst);
  if (why.empty() || why == detail::GracefulShutdown::kShutDownReason || !rt.peers->farewell(dst).empty()) return false;
  const auto now = ReplacementWaits::Clock::now();
  auto timeout = call.timeout.value_or(rt.options.rpc_timeout);
  if (const auto inherited = current_call_context().deadline; inherited != ReplacementWaits::Clock::time_point::max())
    timeout = std::min(timeout, std::chrono::ceil<std::chrono::milliseconds>(inherited - now));
  const std::string who = "worker '" + rt.name_of(dst) + "' (rank " + std::to_string(dst) + ")";
  const bool deadline_first = timeout <= rt.options.replacement_wait;
  auto expired =
      deadline_first
          ? std::make_exception_ptr(
                TimeoutError("call to '" + std::string(call.function) + "' on worker '" + rt.name_of(dst) +
                             "' timed out after " + std::to_string(timeout.count()) +
                             " ms, waiting for a new incarnation of the rank: " + who + " is gone: " + why))
          : std::make_exception_ptr(ConnectionError(
                who + " is gone: " + why + "; no new incarnation took its place within " +
                "RpcOptions::replacement_wait (" + std::to_string(rt.options.replacement_wait.count()) + " ms)"));
  const auto until = now + std::min(timeout, rt.options.replacement_wait);
  if (!rt.replacement_waits.hold(dst, std::move(call), now + timeout, until, std::move(expired), rt.pick_io()))
    return false;
  // The rank may have come back since we looked: then nobody else takes the call out.
  if (rt.peers->is_alive(dst)) restart_held_calls(rt, dst);
  return true;
}

}  // namespace

void restart_held_calls(Runtime::Impl& rt, int rank) {
  for (auto& w : rt.replacement_waits.take(rank)) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(w.deadline - ReplacementWaits::Clock::now());
    w.call.timeout = std::max(left, std::chrono::milliseconds(1));
    start_call(rt, std::move(w.call));
  }
}

void start_call(Runtime::Impl& rt, OutboundCall&& call) noexcept {
  try {
    const int dst = call.dst;
    if (dst < 0 || dst >= rt.world_size) throw UnknownWorkerError("no worker with rank " + std::to_string(dst));
    if (rt.options.replacement_wait.count() > 0 && !call.control && hold_for_replacement(rt, call)) return;
    auto conn = rt.connection_to(dst);  // throws for a dead peer or a closing runtime
    CallEngine::of(*conn).start(conn, std::move(call));
  } catch (...) {
    // The engine completes the call itself once it is registered; anything thrown before that lands here.
    call.complete(call.target, call.dst, nullptr, std::current_exception());
  }
}

void route_replies(FrameDispatcher& frames) {
  frames.on(Route::reply,
            [](const std::shared_ptr<Connection>& c, Message&& m) { CallEngine::of(*c).on_reply(c, std::move(m)); });
}

}  // namespace detail

}  // namespace corpc
