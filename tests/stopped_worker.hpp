// The stopped-worker scenario, shared by test_flow (plain connections) and test_tls (the same over TLS, where every
// write, heartbeats included, goes through the I/O thread and the SSL stream): rank 0 stops worker2 with SIGSTOP from
// inside a call to it (every thread stops; its sockets stay open and answer nothing). Rank 0's call must fail with
// ConnectionError naming worker2 as unreachable once the liveness check gives up on it; rank 1, calling worker2 in a
// loop, must see the same; both still reach each other; rank 0 kills worker2, and both shut down, which fails for
// the job lost worker2. worker2 must be reported killed, the others failed by their shutdown only. Include after
// doctest.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <functional>
#include <thread>

#include "stop_process.hpp"
#include "support.hpp"

namespace corpc::test {

inline int pid_of_rank() { return static_cast<int>(::getpid()); }
inline int stop_whole_process() {
  std::raise(SIGSTOP);
  return 0;
}

// `options` needs a short liveness_timeout and an rpc_timeout longer than the test; `while_stopped` runs on rank 0
// right after worker2 stopped, before its call is expected to fail.
inline void expect_stopped_worker2_declared_unreachable(const RpcOptions& options,
                                                        const std::function<void()>& while_stopped = {}) {
  expect_only_rank_lost(2, "Killed", [&] {
    launch_processes(
        3,
        [&](int rank) {
          init_rpc(worker_name(rank), rank, 3, options);
          if (rank == 2) {
            for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // stopped by rank 0's call, then killed
          }
          if (rank == 0) {
            const int victim = rpc_sync<&pid_of_rank>(2);
            auto stop = rpc_async<&stop_whole_process>(2);
            // The call above stops it from a pool thread; until every thread has stopped, others could still answer.
            wait_until_stopped(victim);
            if (while_stopped) while_stopped();
            auto gone = EXPECT_THROWS_AS(stop.wait(std::chrono::seconds(20) * time_scale()), ConnectionError);
            EXPECT_CONTAINS(gone, "worker2");
            EXPECT_CONTAINS(gone, "unreachable");
            EXPECT(!Runtime::get().is_alive(2));
            EXPECT(rpc_sync<&pid_of_rank>(1) != victim);  // the other link is untouched
            ::kill(victim, SIGKILL);                      // nothing left behind
            shutdown(true);                               // throws: the job lost worker2
            return;
          }
          for (;;) {  // rank 1 calls the stopped worker until its own liveness check gives up on it
            try {
              rpc_sync<&pid_of_rank>(2);
              std::this_thread::sleep_for(std::chrono::milliseconds(10));
            } catch (const ConnectionError& e) {
              EXPECT_CONTAINS(std::string(e.what()), "worker2");
              break;
            }
          }
          EXPECT(!Runtime::get().is_alive(2));
          shutdown(true);
        },
        launch_options(std::chrono::seconds(50)));
  });
}

}  // namespace corpc::test
