// Leveled logging for the library's own messages (internal header). CORPC_LOG=debug|info|warn|error|off chooses what
// is printed to stderr; the default is warn. Each line names the worker and the function it comes from:
//   corpc warn [worker1, init_rpc]: no shared secret ...
// Logging never blocks an I/O thread: its lines go through a bounded queue to a logger thread (dropped, and counted,
// when stderr does not keep up). Messages a peer can trigger at will belong behind a RefusalLog
// (src/transport/refusal_log.hpp).
#pragma once

#include <fmt/format.h>

#include <string_view>
#include <utility>

namespace corpc::detail {

enum class LogLevel { debug, info, warn, error, off };

// From CORPC_LOG, read once; an unknown value means the default (warn), with one warning saying so.
LogLevel log_level();

// corpc's own threads that fork leaves harmless (the logger: a forked child starts its own): launch_processes' fork
// check does not count them.
int fork_safe_threads() noexcept;

void log_line(LogLevel level, std::string_view worker, std::string_view function, std::string_view message);

template <class... Args>
void log(LogLevel level, std::string_view worker, std::string_view function, fmt::format_string<Args...> format,
         Args&&... args) {
  if (level < log_level()) return;
  log_line(level, worker, function, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace corpc::detail
