// The spawn protocol's encodings: the outcomes of earlier calls and the rank's environment, as hex in variables.
#include "rpc/launch_protocol.hpp"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <mutex>

#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/launch.hpp"

namespace corpc::detail {
namespace {

std::optional<SpawnTarget> read_spawn_target() {
  const char* rank = std::getenv(kSpawnRank);
  const char* call = std::getenv(kSpawnCall);
  const char* fd = std::getenv(kReportFd);
  if (!rank || !call || !fd) return std::nullopt;
  return SpawnTarget{std::atoi(rank), std::atoi(call), std::atoi(fd)};
}

const std::optional<SpawnTarget> g_spawn_target = read_spawn_target();  // before main

// The pieces of `s` between `separator`s (one empty piece for an empty `s`).
std::vector<std::string_view> split(std::string_view s, char separator) {
  std::vector<std::string_view> pieces;
  for (std::size_t pos = 0;;) {
    const std::size_t end = std::min(s.find(separator, pos), s.size());
    pieces.push_back(s.substr(pos, end - pos));
    if (end == s.size()) return pieces;
    pos = end + 1;
  }
}

std::string hex(std::string_view s, std::size_t limit = std::string_view::npos) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : s.substr(0, limit)) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string unhex(std::string_view s) {
  auto value = [](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
  std::string out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) out += static_cast<char>(value(s[i]) * 16 + value(s[i + 1]));
  return out;
}

// Each outcome, encoded for kSpawnHistory:
//   "ok" | "usage:<hex what>" | "error:<hex what>" | "failed" then ",<rank>:<hex reason>" per failed rank
// joined by ';'. Texts are cut to 256 bytes: a replay needs the control flow, not the whole text.
std::mutex g_history_mutex;
std::vector<std::string> g_history = [] {
  std::vector<std::string> h;
  if (const char* v = std::getenv(kSpawnHistory); v && *v)
    for (std::string_view outcome : split(v, ';')) h.emplace_back(outcome);
  return h;
}();

void record(std::string outcome) {
  std::lock_guard lock(g_history_mutex);
  g_history.push_back(std::move(outcome));
}

}  // namespace

const std::optional<SpawnTarget>& spawn_target() { return g_spawn_target; }

void record_success() { record("ok"); }

void record_failure(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const LaunchError& e) {
    std::string outcome = "failed";
    for (auto& f : e.failures()) outcome += "," + std::to_string(f.rank) + ":" + hex(f.reason, 256);
    record(std::move(outcome));
  } catch (const UsageError& e) {
    record("usage:" + hex(e.what(), 256));
  } catch (const std::exception& e) {
    record("error:" + hex(e.what(), 256));
  } catch (...) {
    record("error:" + hex("an exception of an unknown type"));
  }
}

std::string history_variable() {
  std::lock_guard lock(g_history_mutex);
  std::string v;
  for (std::size_t i = 0; i < g_history.size(); ++i) v += (i ? ";" : "") + g_history[i];
  return v;
}

void replay_outcome(int call) {
  std::string outcome;
  {
    std::lock_guard lock(g_history_mutex);
    if (call - 1 < static_cast<int>(g_history.size())) outcome = g_history[call - 1];
  }
  if (outcome.empty() || outcome == "ok") return;
  if (outcome.rfind("usage:", 0) == 0) throw UsageError(unhex(outcome.substr(6)));
  if (outcome.rfind("error:", 0) == 0) throw RpcError(unhex(outcome.substr(6)));
  std::vector<RankFailure> failures;
  const auto items = split(outcome, ',');  // "failed", then "<rank>:<hex reason>" each
  for (std::size_t i = 1; i < items.size(); ++i) {
    const std::size_t colon = items[i].find(':');
    failures.push_back({std::atoi(std::string(items[i].substr(0, colon)).c_str()), unhex(items[i].substr(colon + 1))});
  }
  throw LaunchError(std::move(failures));
}

// "name=<hex value>" joined by ';'.
std::string encode_environment(const std::vector<std::pair<std::string, std::string>>& vars) {
  std::string out;
  for (auto& [k, v] : vars) out += (out.empty() ? "" : ";") + k + "=" + hex(v);
  return out;
}

void apply_environment(std::string_view encoded) {
  for (std::string_view item : split(encoded, ';')) {
    const std::size_t eq = item.find('=');
    if (eq != std::string_view::npos)
      ::setenv(std::string(item.substr(0, eq)).c_str(), unhex(item.substr(eq + 1)).c_str(), 1);
  }
}

void apply_spawn_environment() {
  if (const char* vars = std::getenv(kSpawnEnvironment)) apply_environment(vars);
}

}  // namespace corpc::detail
