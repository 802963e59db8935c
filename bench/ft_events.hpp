// What the fault-tolerance benchmarks (ft_bench, pp_ft_bench) share: every process of a job appends timestamped
// events to a file of its own in the run's directory, and the launching process reads them all back once the job has
// ended and times each kill by the commits after it. Also the kills a run hands to the next, and the "none"
// convention of the numbers in their tables.
#pragma once

#include <corpc/ddp/fault_tolerant.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "bench_util.hpp"

namespace corpc::bench {

// ---- the run's directory ----

// The directory every run of a benchmark writes under, made by the caller and named in the environment variable `env`
// for the ranks: under StartMethod::spawn every rank runs main again up to its own launch, so a rank must find the
// caller's directory rather than make one. A rank also logs errors only unless CORPC_LOG says otherwise, since it
// replays the caller's earlier launches and would log their failures again. "" if there is none (the caller's
// mkdtemp failed, said on stderr, or a rank was started without `env`).
inline std::string run_base(bool caller, const std::string& program, const char* env) {
  if (!caller) {
    const char* base = std::getenv(env);
    if (!base) return "";
    if (!std::getenv("CORPC_LOG")) ::setenv("CORPC_LOG", "error", 1);
    return base;
  }
  std::string templ = "/tmp/corpc_" + program + ".XXXXXX";
  if (!::mkdtemp(templ.data())) {
    std::perror((program + ": mkdtemp").c_str());
    return "";
  }
  ::setenv(env, templ.c_str(), 1);
  return templ;
}

// At the end: with --keep (`keep`), says where the runs' files are, `what` naming what they hold; else removes them.
inline void keep_or_remove(const std::string& base, bool keep, const char* what) {
  if (keep) {
    std::printf("# %s kept in %s\n", what, base.c_str());
  } else {
    std::error_code ignored;
    std::filesystem::remove_all(base, ignored);
  }
}

// ---- writing the timestamps ----

// One process's timestamps: "<event> <step> <t_ns>" lines appended to <dir>/<rank>.<pid>, one write each, so that a
// SIGKILL loses nothing written before it. `program` names the benchmark in its error messages.
class EventLog {
 public:
  EventLog(const std::string& dir, int rank, const char* program) : program_(program) {
    const std::string path = dir + "/" + std::to_string(rank) + "." + std::to_string(::getpid());
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error(std::string(program_) + ": cannot open " + path);
  }
  ~EventLog() { ::close(fd_); }
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;
  void operator()(const char* event, std::int64_t step) const {
    char line[128];
    const int n = std::snprintf(line, sizeof line, "%s %lld %lld\n", event, static_cast<long long>(step),
                                static_cast<long long>(now_ns()));
    if (::write(fd_, line, static_cast<std::size_t>(n)) != n) std::perror((std::string(program_) + ": write").c_str());
  }

 private:
  const char* program_;
  int fd_ = -1;
};

// The quorum coordinator's counts, once it is done, as "stat-<name> <count>" events (Tally::coordinator reads them).
inline void log_stats(const EventLog& log, const corpc::ddp::QuorumStats& s) {
  log("stat-commits", s.commits);
  log("stat-aborted", s.aborted_steps);
  log("stat-recoveries", s.recoveries);
  log("stat-last-epoch", s.epoch);
}

// ---- reading them back ----

struct Event {
  int rank;
  int process;  // index into RunEvents::process_start: one per event file
  std::string name;
  std::int64_t step;
  std::int64_t t;
};

// Every process's events of one run, in time order.
struct RunEvents {
  std::vector<Event> events;
  std::vector<std::int64_t> process_start;  // per process, its "start" event's time (the largest time if none)
};

// The event files in `dir`, named <rank>.<pid>; the other files a run keeps there (checkpoints, its kills) are passed
// over.
inline RunEvents read_events(const std::string& dir) {
  RunEvents run;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    const auto dot = name.find('.');
    if (dot == std::string::npos || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    const int rank = std::stoi(name.substr(0, dot));
    const int process = static_cast<int>(run.process_start.size());
    run.process_start.push_back(std::numeric_limits<std::int64_t>::max());
    std::ifstream in(entry.path());
    Event e{rank, process, "", 0, 0};
    while (in >> e.name >> e.step >> e.t) {
      if (e.name == "start") run.process_start[process] = e.t;
      run.events.push_back(e);
    }
  }
  std::sort(run.events.begin(), run.events.end(), [](const Event& a, const Event& b) { return a.t < b.t; });
  return run;
}

// What a job of `steps` steps did, counted from its events before a benchmark times each kill.
struct Tally {
  std::map<std::int64_t, std::int64_t> first_commit;  // step → its first commit anywhere
  std::vector<const Event*> kills;                    // into the RunEvents, in time order
  std::int64_t retries = 0, recoveries = 0;
  std::int64_t extra_steps = 0;  // steps committed past the last (fault tolerant: while a replacement starts)
  std::string coordinator;       // the "stat-" events: "commits 200, aborted 3, ..."
};

inline Tally tally(const RunEvents& run, std::int64_t steps) {
  Tally t;
  std::int64_t max_step = -1;
  for (const auto& e : run.events) {
    if (e.name == "commit") {
      t.first_commit.emplace(e.step, e.t);
      max_step = std::max(max_step, e.step);
    }
    if (e.name == "kill") t.kills.push_back(&e);
    if (e.name == "retry") ++t.retries;
    if (e.name == "recovered") ++t.recoveries;
    if (e.name.rfind("stat-", 0) == 0) {
      if (!t.coordinator.empty()) t.coordinator += ", ";
      t.coordinator += e.name.substr(5) + " " + std::to_string(e.step);
    }
  }
  t.extra_steps = std::max<std::int64_t>(0, max_step + 1 - steps);
  return t;
}

// The job's end: the last step's commit after the last kill, since a restarted job commits steps again; nullopt if
// it never came.
inline std::optional<std::int64_t> job_end(const RunEvents& run, const Tally& t, std::int64_t steps) {
  const std::int64_t last_kill_t = t.kills.empty() ? 0 : t.kills.back()->t;
  for (const auto& e : run.events)
    if (e.name == "commit" && e.step == steps - 1 && e.t > last_kill_t) return e.t;
  return std::nullopt;
}

// `steps` steps that took `ns` nanoseconds.
struct Span {
  std::int64_t steps;
  std::int64_t ns;
};

// The steady state before the first kill (or the job's end), by first commits: from step `warmup`, or halfway in a
// short stretch, to the step before the kill. nullopt if too short to say.
inline std::optional<Span> steady_span(const Tally& t, std::int64_t steps, std::int64_t warmup) {
  const std::int64_t until = t.kills.empty() ? steps - 1 : t.kills.front()->step - 1;
  const std::int64_t from = std::min<std::int64_t>(warmup, until / 2);
  if (until > from && t.first_commit.count(from) && t.first_commit.count(until))
    return Span{until - from, t.first_commit.at(until) - t.first_commit.at(from)};
  return std::nullopt;
}

// The first event after `kill` that match(event, fresh) accepts, where `fresh` says the event's process started after
// the kill (the killed worker's replacement, or a restarted job's); nullptr if none.
template <class Match>
const Event* first_after(const RunEvents& run, const Event& kill, Match match) {
  for (const auto& e : run.events)
    if (e.t > kill.t && match(e, run.process_start[e.process] > kill.t)) return &e;
  return nullptr;
}

inline double ms_since(const Event& kill, const Event& e) { return static_cast<double>(e.t - kill.t) / 1e6; }

// ms_since for --verbose: whole milliseconds, or "never" for no event.
inline std::string ms_since_text(const Event& kill, const Event* e) {
  return e ? std::to_string((e->t - kill.t) / 1'000'000) + " ms" : std::string("never");
}

// ---- the kills ----

// The steps kills come at: offset, offset + every, ... below `steps`, but never step 0 (a process that dies before
// its first step would cost nothing to recover); none for every = 0.
inline std::vector<std::int64_t> kill_steps(std::int64_t steps, std::int64_t every, std::int64_t offset) {
  std::vector<std::int64_t> out;
  if (every <= 0) return out;
  for (std::int64_t s = offset; s < steps; s += every)
    if (s > 0) out.push_back(s);
  return out;
}

// A kill a run made, or is to make. `worker` is the benchmark's own numbering of its workers.
struct Kill {
  std::int64_t step;
  int worker;
};

// A fault-tolerant run may make other kills than planned (it skips or delays a kill nobody could recover from), so
// the restart run after it reads that run's kills from a file ("<step> <worker>" lines) to lose the same.
inline void write_kills(const std::string& path, const std::vector<Kill>& kills) {
  std::ofstream out(path);
  for (const Kill& k : kills) out << k.step << ' ' << k.worker << '\n';
}

// The kills in a write_kills file; nullopt if there is no file (no fault-tolerant run before).
inline std::optional<std::vector<Kill>> read_kills(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::vector<Kill> kills;
  Kill k{};
  while (in >> k.step >> k.worker) kills.push_back(k);
  return kills;
}

// ---- numbers that may be missing ----
// A negative number stands for none (no kill to time, a run too short to measure); cell() prints it as "-".

inline std::string cell(double v, const char* format) {
  if (v < 0) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

inline double mean_or_none(const std::vector<double>& v) {
  if (v.empty()) return -1;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

inline double median_or_none(const std::vector<double>& v) { return v.empty() ? -1 : median(v); }

inline double max_or_none(const std::vector<double>& v) {
  return v.empty() ? -1 : *std::max_element(v.begin(), v.end());
}

}  // namespace corpc::bench
