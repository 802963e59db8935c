// Names the calling thread for the operating system (top -H, ps -L, perf, gdb), so that a profile or a hung process
// shows which of corpc's threads is which.
#pragma once

#include <pthread.h>

#include <string>

namespace corpc::detail {

// Linux keeps 15 characters of a thread's name; longer names are cut, not refused.
inline void name_this_thread(std::string name) {
  if (name.size() > 15) name.resize(15);
  (void)::pthread_setname_np(::pthread_self(), name.c_str());
}

}  // namespace corpc::detail
