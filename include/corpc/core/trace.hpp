/// @file
/// A Chrome trace of what every worker did: calls, remote executions, replies, large tensor
/// transfers, distributed-autograd backward passes (no torch here).
///
/// Turn it on for a job by setting one variable (or RpcOptions::trace_path) on every worker:
///
/// ```
///   CORPC_TRACE=/tmp/job.json build/examples/rpc_hello
/// ```
///
/// and open /tmp/job.json in https://ui.perfetto.dev or chrome://tracing. Each worker is a process (pid = rank + 1,
/// named after the worker: Perfetto keeps pid 0 for the kernel's idle task), its threads are tracks (the thread that
/// called init_rpc, the I/O threads, the worker pool), and a track per connection shows large tensors arriving. Slices:
///
/// ```
///   "f → worker2"        caller's thread: framing and registering call f to worker2 (args: bytes, request id)
///   "f → worker2"        caller's async track: the call in flight, from its start to its reply or failure
///   "f ← master"         callee's thread: f running for master (for a coroutine, up to its first suspension)
///   "reply f → master"   callee: the reply (or error) leaving, whenever the handler finishes
///   "reply f ← worker2"  caller: the reply (or error) arriving; the future completes right after
///   "send 4.0 MiB → …"   a message with at least kLargeTransferBytes of tensor data written; "receive …" read
///   "backward ctx 0:3"   one worker's share of a distributed-autograd backward pass (context 3 of rank 0)
/// ```
///
/// with flow arrows from each call to its execution on the callee and from each reply back to the caller. Flow ids
/// are unique across the job: a hash of (caller rank, callee rank, request id), which both ends know without sending
/// anything extra. The library's own messages (RRef creation, fetches and bookkeeping, backward's gradients) are
/// calls like any other; graceful shutdown's rounds are left out (they run while the parts are being written).
///
/// Cost. Off (the default), each place that could record reads one process-wide flag: one predictable branch, no
/// allocation, no lock. On, each thread appends fixed-size records to a buffer of its own (an uncontended lock, a
/// steady-clock read, the function's name copied); formatting and file writing happen once, at shutdown.
///
/// Merging. During a graceful shutdown, once the world is quiet, each worker writes its part next to the trace
/// (`<path>.rank<N>.json`, itself a valid trace), all meet in one more shutdown round, and rank 0 then merges the
/// parts it finds into `<path>` and deletes them. Written files rather than parts shipped to rank 0 over RPC: the
/// parts are written after the last user message, so they hold everything and add no traffic that graceful
/// shutdown's termination detection would have to count; and a part survives its worker's peers, so a run whose rank 0
/// died still leaves something to merge by hand (merge_chrome_traces, or `corpc-trace merge OUT PART...`). A worker
/// that dies writes no part; the others still merge. Non-graceful shutdown writes the part without waiting for
/// anyone (rank 0 merges what is there at that moment).
///
/// Clocks. Times are the steady clock (CLOCK_MONOTONIC), which is one clock for all the processes of a host, so
/// parts from one machine line up exactly. Across hosts each part has its own origin: the merged trace is right within
/// a worker, but arrows between hosts are shifted by the hosts' clock difference (not estimated here), and the parts
/// must be written to a directory that rank 0 can read (a shared file system), or be collected and merged by hand.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace corpc::trace {

// ---- The recorder ---------------------------------------------------------------------------------------------

/// Messages carrying at least this much tensor data get a "send"/"receive" slice.
inline constexpr std::uint64_t kLargeTransferBytes = std::uint64_t{1} << 20;

namespace detail {
extern std::atomic<bool> g_enabled;  // set by init_rpc, cleared by shutdown
}

/// True while this process's runtime records a trace. Every recording site tests this first (a plain load on x86).
inline bool enabled() noexcept { return detail::g_enabled.load(std::memory_order_relaxed); }

/// The steady clock in nanoseconds: the time base of every slice.
std::int64_t now_ns() noexcept;

/// A slice of the caller's own on this thread's track (a training step's forward, say). Costs nothing when off.
/// ```cpp
///   { corpc::trace::Span s("forward"); out = model(x); }
/// ```
class Span {
 public:
  /// Starts the slice `name` (which must outlive the span: a literal, usually) if tracing is on.
  explicit Span(std::string_view name) : name_(name), start_(enabled() ? now_ns() : 0) {}
  /// Ends the slice and records it on this thread's track.
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::string_view name_;  // must outlive the span (a literal, usually)
  std::int64_t start_;
};

// ---- Chrome trace events (shared with corpc/pipeline/timeline.hpp) ---------------------------------------------

/// One event of Chrome's trace format as a line of JSON. Times are microseconds; strings are escaped.
/// ```cpp
///   ChromeEvent('X', pid, tid).name("step").cat("user").ts(12.5).dur(3).arg("bytes", 64).str()
/// ```
class ChromeEvent {
 public:
  /// 'X' complete, 'M' metadata, 's'/'f' flow start/end, 'b'/'e' async begin/end, 'i' instant.
  ChromeEvent(char phase, std::int64_t pid, std::int64_t tid);
  ChromeEvent& name(std::string_view name);     ///< the slice's label
  ChromeEvent& cat(std::string_view category);  ///< its category
  ChromeEvent& ts(double us);                   ///< start time, microseconds
  ChromeEvent& dur(double us);                  ///< duration, microseconds ('X' events)
  ChromeEvent& id(std::uint64_t id);  ///< flows and async slices: written as a hex string, as Perfetto reads it
  ChromeEvent& bind_enclosing();      ///< a flow end binds to the slice around it, not the next one ("bp":"e")
  ChromeEvent& arg(std::string_view key, std::string_view value);  ///< adds a string to the event's args
  ChromeEvent& arg(std::string_view key, std::int64_t value);      ///< adds a number to the event's args
  std::string str() const;                                         ///< the event as one line of JSON

 private:
  std::string head_, args_;
};

/// Metadata naming a thread (a track), or a process (a worker: two events, its name and its place in the order).
std::string process_name_event(std::int64_t pid, std::string_view name, std::int64_t sort_index);
/// The metadata event naming thread (track) `tid` of process `pid`.
std::string thread_name_event(std::int64_t pid, std::int64_t tid, std::string_view name);

/// Writes {"traceEvents":[...]} with one event per line (the layout merge_chrome_traces reads). False on I/O error.
bool write_chrome_trace(const std::string& path, const std::vector<std::string>& events);

/// Concatenates the events of trace files written by write_chrome_trace (a worker's part, a pipeline timeline) into
/// one trace at `out`. Missing inputs are skipped, and so is a truncated last line (a worker killed while writing).
/// Returns the number of events written; throws std::runtime_error when `out` cannot be written.
std::size_t merge_chrome_traces(const std::string& out, const std::vector<std::string>& inputs);

/// Where the worker of rank `rank` writes its part of the trace at `path`.
std::string part_path(const std::string& path, int rank);

}  // namespace corpc::trace
