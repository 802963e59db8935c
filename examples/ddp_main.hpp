// The entry point the DDP tutorial examples share: under torchrun (or any env:// launcher: RANK is set) this process
// is one rank; otherwise it launches `world` local ranks itself. Errors print and exit non-zero.
#pragma once

#include <corpc/rpc/launch.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>

namespace corpc::examples {

inline int ddp_main(const char* name, int world, const std::function<void()>& demo) {
  try {
    if (std::getenv("RANK") != nullptr) {
      demo();
    } else {
      corpc::launch_processes(world, [&](int) { demo(); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
  return 0;
}

}  // namespace corpc::examples
