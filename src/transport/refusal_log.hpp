// Refusals that a peer can provoke at will (a stranger failing the handshake, a Hello for a rank that is taken),
// logged at a bounded rate: thousands a second must cost a few lines, not one each. The first few of a quiet spell are
// logged in full; the rest are counted and summarised at most once per interval ("N more connections refused in the
// last 5.0 s"), from a timer, so that a burst that stops is still reported. Private to the runtime; any I/O thread.
#pragma once

#include <asio.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "core/log.hpp"

namespace corpc::detail {

class RefusalLog {
 public:
  static constexpr int kInFull = 5;  // per quiet spell
  static constexpr std::chrono::seconds kInterval{5};

  // `function`: the log line's function; `what`: the refusals, counted ("connections refused").
  RefusalLog(std::string function, std::string what) : function_(std::move(function)), what_(std::move(what)) {}

  // One refusal, described by `line`: logged at warn, or counted towards the next summary (written from `io`).
  void refused(asio::io_context& io, const std::string& worker, const std::string& line) {
    std::lock_guard lock(mutex_);
    worker_ = worker;
    const auto now = Clock::now();
    if (!summary_due_ && now - spell_start_ >= kInterval) {  // quiet for an interval: a new spell
      spell_start_ = now;
      in_full_ = 0;
    }
    if (in_full_ < kInFull) {
      ++in_full_;
      log(LogLevel::warn, worker_, function_, "{}", line);
      return;
    }
    ++unreported_;
    if (!summary_due_) schedule_summary(io);
  }

 private:
  using Clock = std::chrono::steady_clock;

  void schedule_summary(asio::io_context& io) {
    if (!timer_) timer_ = std::make_unique<asio::steady_timer>(io);
    summary_due_ = true;
    timer_->expires_at(spell_start_ + kInterval);
    timer_->async_wait([this](const asio::error_code& ec) {
      if (!ec) summarise();
    });
  }

  // The spell goes on with summaries only until an interval passes without a refusal.
  void summarise() {
    std::lock_guard lock(mutex_);
    const auto now = Clock::now();
    const double seconds = std::chrono::duration<double>(now - spell_start_).count();
    log(LogLevel::warn, worker_, function_, "{} more {} in the last {:.1f} s", unreported_, what_, seconds);
    unreported_ = 0;
    summary_due_ = false;
    spell_start_ = now;
    in_full_ = kInFull;
  }

  const std::string function_, what_;
  std::mutex mutex_;  // guards everything below, and the timer's use
  std::string worker_;
  Clock::time_point spell_start_{};
  int in_full_ = 0;
  std::uint64_t unreported_ = 0;
  bool summary_due_ = false;
  std::unique_ptr<asio::steady_timer> timer_;
};

}  // namespace corpc::detail
