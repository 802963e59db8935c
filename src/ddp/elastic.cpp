// launch_with_restarts (see corpc/ddp/elastic.hpp): launch_processes in a loop.
#include "corpc/ddp/elastic.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

#include "core/log.hpp"

namespace corpc::ddp {

int launch_with_restarts(int world_size, const std::function<void(int rank, int restart)>& fn, int max_restarts,
                         LaunchOptions options) {
  for (int restart = 0;; ++restart) {
    ::setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(restart).c_str(), 1);  // the children inherit it
    try {
      launch_processes(
          world_size, [&](int rank) { fn(rank, restart); }, options);
      ::unsetenv("TORCHELASTIC_RESTART_COUNT");
      return restart;
    } catch (const LaunchError& e) {
      if (restart >= max_restarts) {
        ::unsetenv("TORCHELASTIC_RESTART_COUNT");
        throw;
      }
      // A spawned rank replays the earlier attempts' launches up to its own (launch.hpp): only the caller reports them.
      if (!launched_rank())
        corpc::detail::log(corpc::detail::LogLevel::warn, "launcher", "launch_with_restarts",
                           "attempt {} failed, restarting the group ({} of {}):\n{}", restart, restart + 1,
                           max_restarts, e.what());
    }
  }
}

}  // namespace corpc::ddp
