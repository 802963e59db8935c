// Helpers for multi-process tests. Checks inside spawned ranks must throw (doctest's CHECK lives in the parent), so
// EXPECT throws with the location and the failed expression; spawn reports it as that rank's failure.
#pragma once

#include <chrono>
#include <cstdlib>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "corpc/corpc.hpp"

#define EXPECT(cond)                                                                                          \
  do {                                                                                                        \
    if (!(cond)) throw std::runtime_error(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " #cond); \
  } while (0)

#define EXPECT_EQ(a, b)                                                                            \
  do {                                                                                             \
    auto&& va_ = (a);                                                                              \
    auto&& vb_ = (b);                                                                              \
    if (!(va_ == vb_)) {                                                                           \
      std::ostringstream os_;                                                                      \
      os_ << __FILE__ << ":" << __LINE__ << ": " #a " == " #b " failed: " << va_ << " vs " << vb_; \
      throw std::runtime_error(os_.str());                                                         \
    }                                                                                              \
  } while (0)

// Expects `text` (a std::string) to contain `part`; the failure shows the whole text.
#define EXPECT_CONTAINS(text, part)                                                                              \
  do {                                                                                                           \
    const std::string& t_ = (text);                                                                              \
    if (t_.find(part) == std::string::npos)                                                                      \
      throw std::runtime_error(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": expected \"" + (part) + \
                               "\" in: " + t_);                                                                  \
  } while (0)

// Expects `expr` to throw exactly type E (or a subclass); returns its message.
#define EXPECT_THROWS_AS(expr, E)                                                                                 \
  [&]() -> std::string {                                                                                          \
    try {                                                                                                         \
      (void)(expr);                                                                                               \
    } catch (const E& e_) {                                                                                       \
      return e_.what();                                                                                           \
    } catch (const std::exception& e_) {                                                                          \
      throw std::runtime_error(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " #expr " threw " +      \
                               typeid(e_).name() + " (" + e_.what() + "), expected " #E);                         \
    }                                                                                                             \
    throw std::runtime_error(std::string(__FILE__ ":") + std::to_string(__LINE__) + ": " #expr " did not throw"); \
  }()

namespace corpc::test {

inline std::string worker_name(int rank) { return rank == 0 ? "master" : "worker" + std::to_string(rank); }

// Whether this run of the test executable is for `file` ("test_cuda.cpp"): a run of a group's executable is for one
// of its files (CORPC_TEST_FILE, tests/meson.build); a run by hand without it is for all. What a file probes while
// its cases register (a GPU, torchrun) asks this first, so that runs for the other files do not pay for the probe.
inline bool run_is_for(std::string_view file) {
  const char* f = std::getenv("CORPC_TEST_FILE");
  return !f || !*f || file == f;
}

// Sanitized builds run several times slower, and each rank's exit runs LeakSanitizer over a process holding libtorch
// (seconds on a loaded machine): scripts/sanitize.sh sets CORPC_TEST_TIME_SCALE so that the launcher's bounds (the
// whole run, the grace after a first failure) stretch with them. Timeouts that a test asserts on are not scaled.
inline int time_scale() {
  const char* s = std::getenv("CORPC_TEST_TIME_SCALE");
  const int v = s ? std::atoi(s) : 1;
  return v > 0 ? v : 1;
}
// LaunchOptions with both bounds scaled by time_scale(). Test ranks are forks: a spawned rank would run the test
// binary's earlier cases again (doctest's main) up to its launch; test_launch.cpp covers spawn itself. So a test
// process must not have started threads before it launches (at::set_num_threads(1) in main, no backward).
inline LaunchOptions launch_options(std::chrono::milliseconds timeout = std::chrono::minutes(5),
                                    std::chrono::milliseconds grace = std::chrono::seconds(10)) {
  return LaunchOptions{timeout * time_scale(), grace * time_scale(), StartMethod::fork};
}

inline RpcOptions quick_options() {
  RpcOptions o;
  o.init_timeout = std::chrono::seconds(30);
  o.rpc_timeout = std::chrono::seconds(30);
  o.shutdown_timeout = std::chrono::seconds(0);  // wait for the master however long its checks take (spawn bounds it)
  o.num_worker_threads = 4;
  // Stretched in sanitized runs (time_scale): a rank slowed several times must not be declared silent or late.
  o.init_timeout *= time_scale();
  o.rpc_timeout *= time_scale();
  o.liveness_timeout *= time_scale();
  o.handshake_timeout *= time_scale();
  return o;
}

// Runs `job` (a launch of ranks) that must lose exactly one rank: `rank` fails with `reason` in its failure (empty:
// any). Every survivor must have ended by itself, failing its shutdown() with the lost rank named (no rank of a failed
// job exits 0): a graceful shutdown that hung on the lost rank would have it killed at the launcher's bound instead.
// Include after doctest (its checks are spelled DOCTEST_CHECK: torch headers may have brought glog's CHECK by now).
inline void expect_only_rank_lost(int rank, const std::string& reason, const std::function<void()>& job) {
  try {
    job();
    FAIL("rank " << rank << " was expected to fail");
  } catch (const LaunchError& e) {
    INFO(std::string(e.what()));
    bool lost = false;
    for (const auto& f : e.failures()) {
      if (f.rank == rank) {
        lost = true;
        DOCTEST_CHECK(f.reason.find(reason) != std::string::npos);
        continue;
      }
      DOCTEST_CHECK(f.reason.find("shutdown: ") == 0);
      DOCTEST_CHECK(f.reason.find("rank " + std::to_string(rank)) != std::string::npos);
    }
    DOCTEST_CHECK(lost);
  }
}

// Runs `body(rank)` on `world` ranks, each inside init_rpc / graceful shutdown.
inline void run_world(int world, const std::function<void(int)>& body, RpcOptions options = quick_options(),
                      std::chrono::seconds timeout = std::chrono::seconds(120)) {
  const LaunchOptions so = launch_options(timeout);
  launch_processes(
      world,
      [&](int rank) {
        init_rpc(worker_name(rank), rank, world, options);
        body(rank);
        shutdown(true);
      },
      so);
}

}  // namespace corpc::test

// libtorch's c10 logging brings glog, whose CHECK replaces doctest's in every test that includes a torch header
// after doctest: a failed CHECK then aborted the whole test binary ("Check failed: ...") instead of failing its case
// and going on. Taking glog's header here, once, and putting doctest's macro back makes CHECK doctest's everywhere
// below (glog's header has an include guard, so a later torch include does not redefine it).
#include <c10/util/Logging.h>
#ifdef DOCTEST_CHECK
#undef CHECK
#define CHECK(...) DOCTEST_CHECK(__VA_ARGS__)
#endif
