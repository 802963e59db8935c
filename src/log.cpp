#include "log.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

namespace corpc::detail {

namespace {

constexpr std::string_view kNames[] = {"debug", "info", "warn", "error", "off"};

LogLevel parse_level() {
  const char* v = std::getenv("CORPC_LOG");
  if (v == nullptr || *v == '\0') return LogLevel::warn;
  for (int i = 0; i < 5; ++i)
    if (kNames[i] == v) return static_cast<LogLevel>(i);
  std::fprintf(stderr, "corpc warn: CORPC_LOG=%s is not one of debug, info, warn, error, off; using warn\n", v);
  return LogLevel::warn;
}

}  // namespace

LogLevel log_level() {
  static const LogLevel level = parse_level();
  return level;
}

void log_line(LogLevel level, std::string_view worker, std::string_view function, std::string_view message) {
  // One write per line, so that lines from concurrent threads do not interleave.
  std::string line = fmt::format("corpc {} [{}{}{}]: {}\n", kNames[static_cast<int>(level)], worker,
                                 worker.empty() || function.empty() ? "" : ", ", function, message);
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace corpc::detail
