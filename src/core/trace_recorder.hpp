// The trace recorder's side that the runtime calls (private; the public side is corpc/core/trace.hpp). Every site
// tests trace::enabled() before building a Record, so nothing here runs when tracing is off.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/core/trace.hpp"

namespace corpc::trace::detail {

enum class Kind : std::uint8_t {
  call,             // caller: start_call (peer = callee)
  call_failed,      // caller: a registered call ended without a reply (timeout, cancel, lost connection)
  reply_received,   // caller: a reply or error frame completed the call
  run,              // callee: the synchronous part of a handler (peer = caller)
  reply_sent,       // callee: the reply or error frame left
  tensor_send,      // a message with large tensor data written (peer = receiver)
  tensor_receive,   // ... read (peer = sender); drawn on the connection's own track
  backward,         // one worker's share of a backward pass (request = context id)
  span,             // a user's trace::Span
  pipeline_action,  // a pipeline stage's action (F3/s1: forward of micro-batch 3 on stage 1), as in its timeline
};

struct Record {
  Kind kind;
  bool error = false;  // reply_sent / reply_received: an error frame
  int peer = -1;
  std::int64_t t0 = 0, t1 = 0;  // now_ns()
  std::uint64_t request = 0;    // request id (calls), context id (backward)
  std::uint64_t bytes = 0;
  std::string name;  // the function's (SSO keeps the short ones off the heap)
};

// Appends `r` to this thread's buffer.
void record(Record&& r) noexcept;

// A slice from its construction to the end of the scope, for sites with several ways out. `fill` (a lambda that
// captures by reference) builds the record at the end, and only when tracing was on at the start: off, the guard is
// one branch on construction and one on a local at destruction.
template <class Fill>
class ScopedRecord {
 public:
  // `wanted`: a condition of the site's own (tested after enabled(), so it costs nothing when off).
  explicit ScopedRecord(Fill fill, bool wanted = true) noexcept
      : t0_(enabled() && wanted ? now_ns() : 0), fill_(fill) {}
  ~ScopedRecord() { finish(); }
  // Ends the slice now (once). A site ends it before the work stops counting for graceful shutdown, so that a worker
  // never looks idle, and writes its part of the trace, with a record still to come.
  void finish() noexcept {
    if (t0_) [[unlikely]] {
      try {
        Record r = fill_();
        r.t0 = t0_;
        r.t1 = now_ns();
        record(std::move(r));
      } catch (...) {  // out of memory while tracing: the slice is lost, not the call
      }
      t0_ = 0;
    }
  }
  ScopedRecord(const ScopedRecord&) = delete;
  ScopedRecord& operator=(const ScopedRecord&) = delete;

 private:
  std::int64_t t0_;
  Fill fill_;
};

// init_rpc: starts recording for worker `rank` (clears what a former runtime of this process left) when `path` (from
// RpcOptions::trace_path, else CORPC_TRACE) is not empty. Labels the calling thread "main".
void start(const std::string& path, int rank);
// Names the calling thread's track (the runtime's I/O threads).
void label_thread(std::string label);
// The trace's path while recording, else empty.
const std::string& path();
// Writes this worker's part (names: the workers' names by rank). False on I/O error.
bool write_part(const std::vector<std::string>& names);
// Rank 0, after every live worker wrote its part: merges the parts into path() and deletes them.
void merge_parts(int world_size);
// shutdown: recording ends, buffers are dropped.
void stop();

// Flow ids shared by both ends of a call: the call itself, and its reply.
std::uint64_t flow_id(int caller, int callee, std::uint64_t request, bool reply) noexcept;

}  // namespace corpc::trace::detail
