// The trace recorder (per-thread buffers of records, formatted once at shutdown), Chrome trace event formatting, and
// merging of trace files. See corpc/core/trace.hpp for what is recorded and how the parts come together.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "corpc/core/errors.hpp"
#include "corpc/core/executor.hpp"

#include "core/trace_recorder.hpp"

namespace corpc::trace {

namespace detail {
std::atomic<bool> g_enabled{false};
}

std::int64_t now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Span::~Span() {
  if (start_ && enabled())
    detail::record({.kind = detail::Kind::span, .t0 = start_, .t1 = now_ns(), .name = std::string(name_)});
}

// ---- Chrome trace events ------------------------------------------------------------------------------------------

namespace {

void append_quoted(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += buf;
        } else {
          out += c;  // UTF-8 passes through
        }
    }
  }
  out += '"';
}

std::string micros(double us) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.3f", us);
  return buf;
}

}  // namespace

ChromeEvent::ChromeEvent(char phase, std::int64_t pid, std::int64_t tid) {
  head_ = std::string("{\"ph\":\"") + phase + "\",\"pid\":" + std::to_string(pid) + ",\"tid\":" + std::to_string(tid);
}
ChromeEvent& ChromeEvent::name(std::string_view name) {
  head_ += ",\"name\":";
  append_quoted(head_, name);
  return *this;
}
ChromeEvent& ChromeEvent::cat(std::string_view category) {
  head_ += ",\"cat\":";
  append_quoted(head_, category);
  return *this;
}
ChromeEvent& ChromeEvent::ts(double us) {
  head_ += ",\"ts\":" + micros(us);
  return *this;
}
ChromeEvent& ChromeEvent::dur(double us) {
  head_ += ",\"dur\":" + micros(us);
  return *this;
}
ChromeEvent& ChromeEvent::id(std::uint64_t id) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(id));
  head_ += ",\"id\":\"" + std::string(buf) + "\"";
  return *this;
}
ChromeEvent& ChromeEvent::bind_enclosing() {
  head_ += ",\"bp\":\"e\"";
  return *this;
}
ChromeEvent& ChromeEvent::arg(std::string_view key, std::string_view value) {
  args_ += args_.empty() ? "" : ",";
  append_quoted(args_, key);
  args_ += ':';
  append_quoted(args_, value);
  return *this;
}
ChromeEvent& ChromeEvent::arg(std::string_view key, std::int64_t value) {
  args_ += args_.empty() ? "" : ",";
  append_quoted(args_, key);
  args_ += ':' + std::to_string(value);
  return *this;
}
std::string ChromeEvent::str() const { return head_ + (args_.empty() ? "}" : ",\"args\":{" + args_ + "}}"); }

std::string process_name_event(std::int64_t pid, std::string_view name, std::int64_t sort_index) {
  return ChromeEvent('M', pid, 0).name("process_name").arg("name", name).str() + ",\n" +
         ChromeEvent('M', pid, 0).name("process_sort_index").arg("sort_index", sort_index).str();
}

std::string thread_name_event(std::int64_t pid, std::int64_t tid, std::string_view name) {
  return ChromeEvent('M', pid, tid).name("thread_name").arg("name", name).str();
}

bool write_chrome_trace(const std::string& path, const std::vector<std::string>& events) {
  const std::string tmp = path + ".tmp";  // a reader never sees half a trace
  {
    std::ofstream out(tmp);
    out << "{\"traceEvents\":[\n";
    for (std::size_t i = 0; i < events.size(); ++i) out << events[i] << (i + 1 < events.size() ? ",\n" : "\n");
    out << "]}\n";
    if (!out) return ::unlink(tmp.c_str()), false;
  }
  return std::rename(tmp.c_str(), path.c_str()) == 0;
}

namespace {
// A whole event line: an object whose braces balance outside strings (a truncated line does not).
bool complete_event_line(std::string_view line) {
  if (line.size() < 2 || line.front() != '{' || line.back() != '}' || line.rfind("{\"traceEvents\"", 0) == 0)
    return false;
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (in_string) {
      if (c == '\\') ++i;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0 && i + 1 != line.size()) return false;
    }
  }
  return depth == 0 && !in_string;
}
}  // namespace

std::size_t merge_chrome_traces(const std::string& out, const std::vector<std::string>& inputs) {
  std::vector<std::string> events;
  for (const auto& in : inputs) {
    std::ifstream f(in);
    for (std::string line; std::getline(f, line);) {
      if (!line.empty() && line.back() == ',') line.pop_back();
      if (complete_event_line(line)) events.push_back(std::move(line));
    }
  }
  if (!write_chrome_trace(out, events)) throw RpcError("cannot write the trace " + out);
  return events.size();
}

std::string part_path(const std::string& path, int rank) { return path + ".rank" + std::to_string(rank) + ".json"; }

// ---- The recorder -------------------------------------------------------------------------------------------------

namespace detail {

namespace {

// A thread's records. Only its thread appends; the writer takes them at shutdown, hence the (uncontended) lock.
struct Buffer {
  std::mutex mutex;
  std::vector<Record> records;
  std::int64_t tid = 0;
  std::string label;
};

struct Recorder {
  std::mutex mutex;  // guards the list and the settings; never taken while recording into an existing buffer
  std::vector<std::unique_ptr<Buffer>> buffers;  // kept until the process ends: threads hold pointers to them
  std::int64_t next_tid = 1;
  std::string path;
  int rank = -1;
};
Recorder& recorder() {
  static auto* r = new Recorder;  // never destroyed: threads may record during static destruction
  return *r;
}

thread_local Buffer* tls_buffer = nullptr;
thread_local std::string tls_label;

Buffer& this_thread_buffer() {
  if (tls_buffer) return *tls_buffer;
  auto& rec = recorder();
  auto b = std::make_unique<Buffer>();
  const bool pool = dynamic_cast<ThreadPool*>(current_executor()) != nullptr;
  std::lock_guard lock(rec.mutex);
  b->tid = rec.next_tid++;
  b->label = !tls_label.empty() ? tls_label : (pool ? "pool " : "thread ") + std::to_string(b->tid);
  tls_buffer = b.get();
  rec.buffers.push_back(std::move(b));
  return *tls_buffer;
}

constexpr std::int64_t kConnectionTracks = 1'000'000;  // tids of the per-connection receive tracks: this + peer rank

double us(std::int64_t ns) { return static_cast<double>(ns) / 1000.0; }

std::string mib(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

// One record as Chrome events: a complete slice, plus the flow and async ends it carries.
void format(const Record& r, int rank, std::int64_t tid, const std::vector<std::string>& names,
            std::vector<std::string>& out) {
  const std::int64_t pid = rank + 1;
  const std::string peer =
      r.peer >= 0 && r.peer < static_cast<int>(names.size()) ? names[r.peer] : "rank " + std::to_string(r.peer);
  const double t0 = us(r.t0), dur = std::max(us(r.t1) - t0, 0.002), inset = std::min(dur / 2, 0.001);
  auto slice = [&](std::string name, std::string_view cat, std::int64_t on_tid = 0) {
    return std::move(ChromeEvent('X', pid, on_tid ? on_tid : tid).name(name).cat(cat).ts(t0).dur(dur));
  };
  // A flow leaves at the end of its slice and arrives at the start of the other (1 ns inside each, so that it binds).
  auto flow = [&](char phase, std::string_view what, std::uint64_t id) {
    ChromeEvent e(phase, pid, tid);
    e.name(what).cat("flow").ts(phase == 's' ? t0 + dur - inset : t0 + inset).id(id);
    if (phase == 'f') e.bind_enclosing();
    out.push_back(e.str());
  };
  auto in_flight = [&](char phase) {  // the caller's async slice of the call, begun at `call`, ended at its outcome
    out.push_back(ChromeEvent(phase, pid, tid)
                      .name(r.name + " → " + peer)
                      .cat("in flight")
                      .ts(t0)
                      .id(flow_id(rank, r.peer, r.request, false))
                      .str());
  };
  const auto bytes = static_cast<std::int64_t>(r.bytes);
  const auto request = static_cast<std::int64_t>(r.request);
  switch (r.kind) {
    case Kind::call:
      out.push_back(
          slice(r.name + " → " + peer, "call").arg("to", peer).arg("bytes", bytes).arg("request", request).str());
      flow('s', "call", flow_id(rank, r.peer, r.request, false));
      in_flight('b');
      break;
    case Kind::call_failed:
      out.push_back(slice("failed: " + r.name + " → " + peer, "call").arg("request", request).str());
      in_flight('e');
      break;
    case Kind::reply_received:
      out.push_back(slice("reply " + r.name + " ← " + peer, "reply")
                        .arg("from", peer)
                        .arg("bytes", bytes)
                        .arg("error", r.error ? 1 : 0)
                        .str());
      flow('f', "reply", flow_id(rank, r.peer, r.request, true));
      in_flight('e');
      break;
    case Kind::run:
      out.push_back(
          slice(r.name + " ← " + peer, "run").arg("from", peer).arg("bytes", bytes).arg("request", request).str());
      flow('f', "call", flow_id(r.peer, rank, r.request, false));
      break;
    case Kind::reply_sent:
      out.push_back(slice("reply " + r.name + " → " + peer, "reply")
                        .arg("to", peer)
                        .arg("bytes", bytes)
                        .arg("error", r.error ? 1 : 0)
                        .str());
      flow('s', "reply", flow_id(r.peer, rank, r.request, true));
      break;
    case Kind::tensor_send:
      out.push_back(slice("send " + mib(r.bytes) + " → " + peer, "tensors").arg("bytes", bytes).str());
      break;
    case Kind::tensor_receive:
      out.push_back(slice("receive " + mib(r.bytes) + " ← " + peer, "tensors", kConnectionTracks + r.peer)
                        .arg("bytes", bytes)
                        .str());
      break;
    case Kind::backward: {
      // Context ids are (creator rank + 1) << 40 | sequence number.
      const auto ctx = static_cast<std::int64_t>(r.request);
      out.push_back(
          slice("backward ctx " + std::to_string((ctx >> 40) - 1) + ":" + std::to_string(ctx & ((1LL << 40) - 1)),
                "autograd")
              .arg("context", ctx)
              .str());
      break;
    }
    case Kind::span: out.push_back(slice(r.name, "user").str()); break;
    case Kind::pipeline_action: out.push_back(slice(r.name, "pipeline").str()); break;
  }
}

}  // namespace

void record(Record&& r) noexcept {
  try {
    Buffer& b = this_thread_buffer();
    std::lock_guard lock(b.mutex);
    b.records.push_back(std::move(r));
  } catch (...) {  // out of memory while tracing: the record is lost, not the call
  }
}

void start(const std::string& path, int rank) {
  auto& rec = recorder();
  {
    std::lock_guard lock(rec.mutex);
    rec.path = path;
    rec.rank = rank;
    for (auto& b : rec.buffers) {  // a former runtime's (or, after fork, the parent's) records
      std::lock_guard block(b->mutex);
      b->records.clear();
    }
  }
  label_thread("main");
  g_enabled.store(!path.empty());
}

void label_thread(std::string label) {
  if (tls_buffer) {
    std::lock_guard lock(tls_buffer->mutex);
    tls_buffer->label = label;
  }
  tls_label = std::move(label);
}

const std::string& path() { return recorder().path; }

bool write_part(const std::vector<std::string>& names) {
  auto& rec = recorder();
  std::lock_guard lock(rec.mutex);
  if (rec.path.empty()) return true;
  const int rank = rec.rank;
  std::vector<std::string> events;
  events.push_back(process_name_event(
      rank + 1, rank < static_cast<int>(names.size()) ? names[rank] : "rank " + std::to_string(rank), rank));
  std::vector<bool> receive_track(names.size());
  for (auto& b : rec.buffers) {
    std::vector<Record> records;
    std::string label;
    {
      std::lock_guard block(b->mutex);
      records.swap(b->records);
      label = b->label;
    }
    if (records.empty()) continue;
    events.push_back(thread_name_event(rank + 1, b->tid, label));
    for (auto& r : records) {
      format(r, rank, b->tid, names, events);
      if (r.kind == Kind::tensor_receive && r.peer >= 0 && r.peer < static_cast<int>(names.size()))
        receive_track[r.peer] = true;
    }
  }
  for (std::size_t p = 0; p < receive_track.size(); ++p)
    if (receive_track[p])
      events.push_back(
          thread_name_event(rank + 1, kConnectionTracks + static_cast<std::int64_t>(p), "receive ← " + names[p]));
  return write_chrome_trace(part_path(rec.path, rank), events);
}

void merge_parts(int world_size) {
  const std::string out = path();
  if (out.empty()) return;
  std::vector<std::string> parts;
  for (int r = 0; r < world_size; ++r) parts.push_back(part_path(out, r));
  try {
    merge_chrome_traces(out, parts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "corpc: trace not merged (%s); the parts stay in %s.rank*.json\n", e.what(), out.c_str());
    return;
  }
  for (auto& p : parts) ::unlink(p.c_str());
}

void stop() {
  g_enabled.store(false);
  auto& rec = recorder();
  std::lock_guard lock(rec.mutex);
  rec.path.clear();
  for (auto& b : rec.buffers) {
    std::lock_guard block(b->mutex);
    b->records = {};
  }
}

std::uint64_t flow_id(int caller, int callee, std::uint64_t request, bool reply) noexcept {
  auto mix = [](std::uint64_t x) {  // splitmix64's finalizer: distinct inputs collide with probability ~2^-64
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  const std::uint64_t pair = (std::uint64_t(std::uint32_t(caller)) << 32 | std::uint32_t(callee)) * 2 + (reply ? 1 : 0);
  return mix(request ^ mix(pair));
}

}  // namespace detail

}  // namespace corpc::trace
