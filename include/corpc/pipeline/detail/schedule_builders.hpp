/// @file
/// The schedules whose order is found by running it: ZB-H1 and the list scheduler behind the interleaved zero
/// bubble, ZBV and DualPipeV orders (corpc/pipeline/schedule.hpp says what each is). No torch here.
#pragma once

#include <algorithm>
#include <deque>
#include <utility>
#include <vector>

#include "corpc/pipeline/action.hpp"

namespace corpc::pipeline::detail {

// ZB-H1's order: each worker runs 1F1B's forwards and input-backwards (I) in 1F1B's order, and a pending W whenever
// that next action would have to wait (or a forward would hold more micro-batches than 1F1B does); the Ws left at
// the end run last. The order is found by running it with unit times (F = I = W), which is the case ZB-H1 is
// designed for; with other times it stays a valid order, only the bubble differs.
inline std::vector<std::vector<Action>> zero_bubble_h1(int K, int M) {
  std::vector<std::vector<Action>> main(K), plan(K);
  for (int r = 0; r < K; ++r) {
    const int warm = std::min(K - 1 - r, M);
    for (int m = 0; m < warm; ++m) main[r].push_back(Action{ActionKind::Forward, r, m});
    for (int m = 0; m < M; ++m) {
      if (warm + m < M) main[r].push_back(Action{ActionKind::Forward, r, warm + m});
      main[r].push_back(Action{ActionKind::BackwardInput, r, m});
    }
  }
  const long kNever = -1;
  std::vector<std::vector<long>> fwd(K, std::vector<long>(M, kNever)), grad(K, std::vector<long>(M, kNever));
  std::vector<std::size_t> next(K, 0);
  std::vector<std::deque<int>> pending_w(K);
  std::vector<int> held(K, 0);
  auto done_by = [&](long at, long t) { return at != kNever && at <= t; };
  for (long t = 0;; ++t) {
    bool busy = false;
    std::vector<std::pair<int, Action>> finished;  // visible to others from t + 1
    for (int r = 0; r < K; ++r) {
      if (next[r] < main[r].size()) {
        busy = true;
        const Action& a = main[r][next[r]];
        const bool ready = a.kind == ActionKind::Forward ? (r == 0 || done_by(fwd[r - 1][a.micro], t))
                                                         : (r == K - 1 || done_by(grad[r + 1][a.micro], t));
        const bool room = a.kind != ActionKind::Forward || held[r] < K - r;
        if (ready && room) {
          plan[r].push_back(a);
          finished.emplace_back(r, a);
          if (a.kind == ActionKind::Forward) ++held[r];
          else pending_w[r].push_back(a.micro);
          ++next[r];
          continue;
        }
      }
      if (!pending_w[r].empty() && next[r] < main[r].size()) {
        plan[r].push_back(Action{ActionKind::BackwardWeight, r, pending_w[r].front()});
        pending_w[r].pop_front();
        --held[r];
      }
    }
    for (auto& [r, a] : finished) (a.kind == ActionKind::Forward ? fwd : grad)[r][a.micro] = t + 1;
    if (!busy) break;
  }
  for (int r = 0; r < K; ++r)
    for (int m : pending_w[r]) plan[r].push_back(Action{ActionKind::BackwardWeight, r, m});
  return plan;
}

// A list scheduler run with unit times (F = I = W = 1, an unsplit B = 2): backwards split into I and W always (zero
// bubble), or once the worker has no forward left (DualPipeV: whole Bs to pair with forwards in the steady state,
// then Ws to fill the cool-down). At every free moment a worker takes, in
// this order of preference, a backward whose gradient has arrived (the lowest micro-batch, the deepest stage first:
// it is what the stages upstream wait for), a forward whose activation has arrived (the deepest stage first: it
// reaches the loss, and so a backward, soonest), or a pending W (zero bubble fills waits with it). Memory is bounded
// by `first_chunk_cap[r]`: worker r starts a micro-batch on its first stage only while fewer than that many are
// between their forward there and the end of their backward there. Later stages are never held back, and every
// micro-batch held on a later stage of r is also held on its first stage, so r holds at most cap micro-batches per
// stage, and the order cannot deadlock (the deepest work in flight can always go on). `stage_worker[s]` places the
// stages: any placement where each worker's stages are visited in order by a micro-batch works (loop, V).
enum class SplitBackward { always, once_forwards_end };
inline std::vector<std::vector<Action>> list_schedule(int K, int S, int M, const std::vector<int>& stage_worker,
                                                      SplitBackward split, const std::vector<int>& first_chunk_cap) {
  std::vector<std::vector<int>> hosted(K);  // per worker, its stages in ascending order
  for (int s = 0; s < S; ++s) hosted[stage_worker[s]].push_back(s);
  const long kNever = -1;
  std::vector<std::vector<long>> fwd(S, std::vector<long>(M, kNever)), grad(S, std::vector<long>(M, kNever));
  std::vector<int> next_f(S, 0), next_b(S, 0), open_first(K, 0);
  std::vector<long> busy_until(K, 0);
  std::vector<std::deque<std::pair<int, int>>> pending_w(K);
  std::vector<std::vector<Action>> plan(K);
  auto by = [](long at, long t) { return at != kNever && at <= t; };
  auto left = [&] {
    for (int s = 0; s < S; ++s)
      if (next_b[s] < M) return true;
    for (auto& p : pending_w)
      if (!p.empty()) return true;
    return false;
  };
  for (long t = 0; left(); ++t) {
    for (int r = 0; r < K; ++r) {
      if (busy_until[r] > t || hosted[r].empty()) continue;
      const int first = hosted[r].front();
      int bs = -1;
      for (auto it = hosted[r].rbegin(); it != hosted[r].rend(); ++it) {
        const int s = *it, m = next_b[s];
        if (m >= M || !by(fwd[s][m], t) || (s + 1 < S && !by(grad[s + 1][m], t))) continue;
        if (bs < 0 || m < next_b[bs]) bs = s;
      }
      if (bs >= 0) {
        bool split_backward = split == SplitBackward::always;
        if (!split_backward) {
          split_backward = true;
          for (int s : hosted[r]) split_backward = split_backward && next_f[s] >= M;
        }
        const int m = next_b[bs]++;
        const long cost = split_backward ? 1 : 2;
        plan[r].push_back(Action{split_backward ? ActionKind::BackwardInput : ActionKind::Backward, bs, m});
        grad[bs][m] = t + cost;
        busy_until[r] = t + cost;
        if (split_backward) pending_w[r].emplace_back(bs, m);
        else if (bs == first) --open_first[r];
        continue;
      }
      int fs = -1;
      for (auto it = hosted[r].rbegin(); it != hosted[r].rend() && fs < 0; ++it) {
        const int s = *it, m = next_f[s];
        if (m >= M || (s > 0 && !by(fwd[s - 1][m], t))) continue;
        if (s == first && open_first[r] >= first_chunk_cap[r]) continue;
        fs = s;
      }
      if (fs >= 0) {
        const int m = next_f[fs]++;
        plan[r].push_back(Action{ActionKind::Forward, fs, m});
        fwd[fs][m] = t + 1;
        busy_until[r] = t + 1;
        if (fs == first) ++open_first[r];
        continue;
      }
      if (!pending_w[r].empty()) {
        auto [s, m] = pending_w[r].front();
        pending_w[r].pop_front();
        plan[r].push_back(Action{ActionKind::BackwardWeight, s, m});
        busy_until[r] = t + 1;
        if (s == first) --open_first[r];
      }
    }
  }
  return plan;
}

// Marks DualPipeV's overlapped pairs: a forward directly followed by a backward of another stage on the same worker
// runs as one action, the two in whichever order their inputs arrive.
inline void pair_forward_backward(std::vector<std::vector<Action>>& plan) {
  for (auto& list : plan)
    for (std::size_t i = 0; i + 1 < list.size(); ++i)
      if (list[i].kind == ActionKind::Forward && list[i + 1].kind == ActionKind::Backward &&
          list[i].stage != list[i + 1].stage) {
        list[i].overlap = true;
        ++i;
      }
}

}  // namespace corpc::pipeline::detail
