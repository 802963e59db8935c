// Join (uneven inputs, see ddp.hpp): while a join is open every rank votes once per step; a rank that has run out of
// inputs keeps answering the others' collectives until none trains, then every rank adopts the model of one that
// trained to the end.
#include "corpc/rpc/errors.hpp"

#include "ddp/gradient_sync.hpp"

namespace corpc::ddp {

// Join: the allreduce every rank makes once per step while a join is open. Returns (ranks training, whether
// they synchronise gradients this step); sets the divisor and the rank buffers come from.
std::pair<int64_t, bool> GradientSync::State::join_vote(bool training, bool wants_sync) {
  const int64_t world = group->getSize();
  auto votes = at::zeros({world + 1}, at::kLong);
  if (training) {
    votes[group->getRank()] = 1;
    votes[world] = wants_sync ? 1 : 0;
  }
  std::vector<at::Tensor> t{votes};
  group->allreduce(t)->wait();
  auto v = t[0];
  const int64_t active = v.narrow(0, 0, world).sum().item<int64_t>();
  if (active > 0) {
    source_rank = v.narrow(0, 0, world).nonzero().max().item<int64_t>();
    last_source_rank = source_rank;
  }
  std::lock_guard<std::mutex> lock(mutex);
  divisor = join_options.divide_by_initial_world_size || active == 0 ? world : active;
  return {active, v[world].item<int64_t>() > 0};
}

// A joined rank's share of one step of the others: what their forward and backward do collectively.
void GradientSync::State::shadow_step(bool synchronised) {
  if (has_buffers_to_broadcast()) broadcast(buffers, source_rank);
  if (!synchronised) return;
  std::lock_guard<std::mutex> lock(mutex);
  torch::NoGradGuard no_grad;
  reset_locked();
  for (auto& b : buckets) {
    b.flat.zero_();  // a joined rank contributes nothing
    b.pending = 0;
  }
  launch_ready_locked();
  for (size_t bi = 0; bi < buckets.size(); ++bi) wait_bucket_locked(bi);
}

void GradientSync::join_begin(JoinOptions options) {
  auto& s = *state_;
  if (s.joining) throw UsageError("DDP: join() while a join is already open");
  s.joining = true;
  s.join_options = options;
  s.last_source_rank = -1;
}

void GradientSync::join_finish() {
  auto& s = *state_;
  for (;;) {
    const auto [active, synchronised] = s.join_vote(/*training=*/false, false);
    if (active == 0) break;
    s.shadow_step(synchronised);
  }
  join_abandon();
  // Joined ranks skipped the last optimizer steps: everyone adopts the model of a rank that trained to the end.
  if (s.last_source_rank >= 0) {
    auto all = s.params;
    all.insert(all.end(), s.buffers.begin(), s.buffers.end());
    s.broadcast(all, s.last_source_rank);
  }
}

void GradientSync::join_abandon() {
  auto& s = *state_;
  s.joining = false;
  s.source_rank = 0;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.divisor = s.group->getSize();
}

}  // namespace corpc::ddp
