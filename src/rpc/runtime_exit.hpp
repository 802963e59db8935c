// What happens to a runtime that its program did not shut down: at exit, and when a launched rank's function returns.
#pragma once

#include <string>

namespace corpc::detail {

// Shuts down a runtime that is still running when its rank is done. `error`: what the rank failed with ("" if it
// returned normally), sent to the peers as shutdown_after_error does. A rank that returned normally is shut down
// gracefully, with a warning that it did not call shutdown() itself, unless the job lost a rank (or this is one of
// the runtime's own threads): then as after an error. Returns what makes this rank's run a failure ("" if nothing):
// the graceful shutdown's complaint, or why it was closed as after an error. Does nothing if no runtime runs.
std::string close_runtime_left_open(const std::string& error);

}  // namespace corpc::detail
