// Calls to a rank that died, held until a new incarnation takes the rank (RpcOptions::replacement_wait): a launcher
// that restarts ranks in place brings the rank back within seconds, and a call made in between would otherwise fail
// although the job goes on. Each held call leaves when the rank is taken back (it is then started as if just made),
// when the wait or its own deadline passes (TimeoutError), or when the runtime closes (ShutdownError), whichever comes
// first. Any thread may use it; one lock guards it, never held while a call is started or completed.
#pragma once

#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "corpc/rpc/detail/outbound.hpp"

namespace corpc::detail {

class ReplacementWaits {
 public:
  using Clock = std::chrono::steady_clock;

  ReplacementWaits();
  ~ReplacementWaits();

  // Holds `call` to `rank`, whose own deadline is `deadline`, until `until` (its timer on `io`), then fails it with
  // `expired`. False once closed: the call is left to the caller to fail.
  bool hold(int rank, OutboundCall&& call, Clock::time_point deadline, Clock::time_point until,
            std::exception_ptr expired, asio::io_context& io);
  // A call taken out, with the name its `function` views.
  struct Waiting {
    OutboundCall call;
    std::unique_ptr<std::string> function;
    Clock::time_point deadline;  // the call's own: started again, it gets what is left of it
  };
  // The calls held for `rank`, taken out: the rank has a new incarnation, so they are to be started again.
  std::vector<Waiting> take(int rank);
  // From now on nothing is held; returns what was (to fail with ShutdownError).
  std::vector<Waiting> close();

 private:
  struct Held {
    std::uint64_t id = 0;
    Waiting waiting;  // its name owned: the caller's storage may be gone by the time it leaves
  };
  struct State {
    mutable std::mutex mutex;
    bool closed = false;
    std::uint64_t next_id = 1;
    std::map<int, std::list<Held>> held;  // by rank
  };
  static void expire(const std::shared_ptr<State>& state, int rank, std::uint64_t id, std::exception_ptr error);

  // Shared with the timers' handlers, which may run after this object is gone (they then find nothing). A timer is
  // never cancelled: it lives in its own handler, and one that fires for a call taken out finds nothing.
  std::shared_ptr<State> state_;
};

}  // namespace corpc::detail
