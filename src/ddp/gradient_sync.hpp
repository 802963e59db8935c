// GradientSync's state, shared by the files that implement it, one seam each:
//   gradient_buckets.cpp   which parameters share a bucket, and the views of a bucket's flat buffer
//   accumulator_hooks.cpp  the hooks on the parameters' gradient accumulators, and find_unused_parameters
//   bucket_allreduce.cpp   each bucket's allreduce, launched as the bucket fills (overlapping backward), and the
//                          end-of-backward wait that gives every parameter its averaged gradient
//   join.cpp               Join (uneven inputs): the vote each step, and a joined rank's share of the others' steps
//   ddp.cpp                the comm hooks, construction, the coalesced broadcast, the forward hooks and counts
// One struct: the parts meet in the buckets and under one mutex, which the accumulator hooks (autograd's threads),
// the end-of-backward callback and the training thread all take.
#pragma once

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "corpc/ddp/ddp.hpp"
#include "corpc/detail/torch_compat.hpp"

namespace corpc::ddp {

struct GradientSync::State : std::enable_shared_from_this<GradientSync::State> {
  struct Bucket {
    std::vector<size_t> params;  // indices into State::params
    std::vector<int64_t> offsets;
    at::Tensor flat;
    std::vector<bool> ready;
    size_t pending = 0;
    c10::intrusive_ptr<c10::ivalue::Future> result;
  };
  struct Slot {
    size_t bucket;
    size_t index;  // within the bucket
  };

  c10::intrusive_ptr<c10d::ProcessGroup> group;
  DdpOptions options;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  std::vector<Bucket> buckets;
  std::vector<Slot> slots;
  std::vector<corpc::detail::NodeRef<torch::autograd::Node>> accumulators;  // kept alive: autograd holds them weakly

  mutable std::mutex mutex;
  bool sync = true;
  bool in_backward = false;
  size_t next_launch = 0;
  size_t launched_early = 0;  // of the current / last backward
  // The distributed autograd context whose backward pass this is (its gradients live there, not in .grad), or -1.
  std::int64_t pass_context = -1;
  std::vector<bool> unused;  // find_unused_parameters: not reachable from the last forward's output

  // Join (uneven inputs): see ddp.hpp.
  bool joining = false;
  JoinOptions join_options;
  int64_t divisor = 1;            // of the current step's gradients
  int64_t source_rank = 0;        // buffers come from here: the highest rank still training
  int64_t last_source_rank = -1;  // source_rank of the last step any rank trained in

  // Buckets (gradient_buckets.cpp): reverse registration order, up to bucket_cap_mb, one dtype and device each.
  void build_buckets();
  at::Tensor view_of(const Bucket& b, size_t k) const;
  bool is_bucket_view(const at::Tensor& grad, const Bucket& b, size_t k) const;

  // Accumulator hooks (accumulator_hooks.cpp).
  void follow_accumulators();
  void on_grad_ready(size_t i);
  void find_unused(const at::Tensor& output);

  // Allreduce and the end-of-backward wait (bucket_allreduce.cpp); *_locked: `mutex` held.
  bool views_in_use() const { return options.gradient_as_bucket_view && pass_context < 0; }
  // The default hook (none given): the gradients are divided on their way into the bucket, and the bucket's
  // allreduce is the whole hook. One pass over the gradients less than dividing the sum afterwards (PyTorch does
  // the same); for N ranks the sum of g_i / N rounds differently from (sum g_i) / N only when N is not a power of 2.
  bool builtin_allreduce() const { return !options.comm_hook; }
  at::Tensor current_grad(size_t i) const;
  void reset_locked();
  void launch_ready_locked();
  void fill_slot_locked(Bucket& b, size_t k);
  void mark_ready_locked(size_t i);
  at::Tensor wait_bucket_locked(size_t bi);
  void finish_backward();     // launch_rest_locked, then write_back_locked
  void launch_rest_locked();  // every bucket not launched yet, with what its gradients hold now (zero if none)
  void write_back_locked();   // waits for every bucket; the averages into .grad (or the pass's context)

  // Parameters and buffers alike on every rank (ddp.cpp).
  void broadcast(std::vector<at::Tensor>& tensors, int64_t root = 0);
  bool has_buffers_to_broadcast() const {
    return options.broadcast_buffers && !buffers.empty() && group->getSize() > 1;
  }

  // Join (join.cpp).
  std::pair<int64_t, bool> join_vote(bool training, bool wants_sync);
  void shadow_step(bool synchronised);
};

}  // namespace corpc::ddp
