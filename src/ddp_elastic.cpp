// launch_with_restarts (see corpc/ddp/elastic.hpp): launch_processes in a loop.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "corpc/ddp/elastic.hpp"

namespace corpc::ddp {

int launch_with_restarts(int world_size, const std::function<void(int rank, int restart)>& fn, int max_restarts,
                         LaunchOptions options) {
  for (int restart = 0;; ++restart) {
    ::setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(restart).c_str(), 1);  // the children inherit it
    try {
      launch_processes(world_size, [&](int rank) { fn(rank, restart); }, options);
      ::unsetenv("TORCHELASTIC_RESTART_COUNT");
      return restart;
    } catch (const LaunchError& e) {
      if (restart >= max_restarts) {
        ::unsetenv("TORCHELASTIC_RESTART_COUNT");
        throw;
      }
      std::fprintf(stderr, "launch_with_restarts: attempt %d failed, restarting the group (%d of %d):\n%s\n",
                   restart, restart + 1, max_restarts, e.what());
    }
  }
}

}  // namespace corpc::ddp
