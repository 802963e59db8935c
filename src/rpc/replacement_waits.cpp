#include "rpc/replacement_waits.hpp"

#include <algorithm>

#include "corpc/rpc/errors.hpp"

namespace corpc::detail {

ReplacementWaits::ReplacementWaits() : state_(std::make_shared<State>()) {}

ReplacementWaits::~ReplacementWaits() {
  for (auto& w : close())
    w.call.complete(w.call.target, w.call.dst, nullptr,
                    std::make_exception_ptr(ShutdownError("corpc runtime shut down")));
}

bool ReplacementWaits::hold(int rank, OutboundCall&& call, Clock::time_point deadline, Clock::time_point until,
                            std::exception_ptr expired, asio::io_context& io) {
  std::lock_guard lock(state_->mutex);
  if (state_->closed) return false;
  Held h;
  h.id = state_->next_id++;
  h.waiting.function = std::make_unique<std::string>(call.function);
  h.waiting.call = std::move(call);
  h.waiting.call.function = *h.waiting.function;
  h.waiting.call.function_is_static = false;
  h.waiting.deadline = deadline;
  auto timer = std::make_shared<asio::steady_timer>(io, until);
  timer->async_wait([timer, weak = std::weak_ptr<State>(state_), rank, id = h.id,
                     expired = std::move(expired)](const asio::error_code& ec) {
    if (ec) return;
    if (auto state = weak.lock()) expire(state, rank, id, expired);
  });
  state_->held[rank].push_back(std::move(h));
  return true;
}

void ReplacementWaits::expire(const std::shared_ptr<State>& state, int rank, std::uint64_t id,
                              std::exception_ptr error) {
  Waiting w;
  {
    std::lock_guard lock(state->mutex);
    auto calls = state->held.find(rank);
    if (calls == state->held.end()) return;  // taken out before its time
    auto it = std::find_if(calls->second.begin(), calls->second.end(), [id](const Held& h) { return h.id == id; });
    if (it == calls->second.end()) return;
    w = std::move(it->waiting);
    calls->second.erase(it);
    if (calls->second.empty()) state->held.erase(calls);
  }
  w.call.complete(w.call.target, w.call.dst, nullptr, error);
}

std::vector<ReplacementWaits::Waiting> ReplacementWaits::take(int rank) {
  std::list<Held> calls;
  {
    std::lock_guard lock(state_->mutex);
    auto it = state_->held.find(rank);
    if (it == state_->held.end()) return {};
    calls = std::move(it->second);
    state_->held.erase(it);
  }
  std::vector<Waiting> out;
  for (auto& h : calls) out.push_back(std::move(h.waiting));
  return out;
}

std::vector<ReplacementWaits::Waiting> ReplacementWaits::close() {
  std::map<int, std::list<Held>> all;
  {
    std::lock_guard lock(state_->mutex);
    state_->closed = true;
    all.swap(state_->held);
  }
  std::vector<Waiting> out;
  for (auto& [rank, calls] : all)
    for (auto& h : calls) out.push_back(std::move(h.waiting));
  return out;
}

}  // namespace corpc::detail
