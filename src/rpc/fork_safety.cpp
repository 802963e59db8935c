// Counting the threads a fork would strand, from /proc/self/task.
#include "rpc/fork_safety.hpp"

#include <dirent.h>

#include "core/log.hpp"

namespace corpc::detail {
namespace {

int threads_in_this_process() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d))
      if (e->d_name[0] != '.') ++n;
    ::closedir(d);
  }
  return n;
}

// Threads that shared libraries start as they load are there before any code of the program runs.
const int g_threads_at_start = threads_in_this_process();

}  // namespace

int threads_fork_would_strand() {
#if defined(__SANITIZE_THREAD__)
  return 0;  // ThreadSanitizer starts a thread of its own at the first pthread_create, and reports such a fork itself
#else
  return threads_in_this_process() - g_threads_at_start - fork_safe_threads();
#endif
}

}  // namespace corpc::detail
