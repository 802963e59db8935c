// The buckets' allreduce: each bucket is launched once all its gradients are in, strictly in bucket order (so that
// communication overlaps the rest of backward), and the end-of-backward wait puts the averages where the gradients
// belong: .grad (or its bucket view), or the distributed autograd context of the pass.
#include <torch/csrc/autograd/variable.h>

#include <string>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/rpc/errors.hpp"
#include "corpc/rpc/runtime.hpp"

#include "ddp/gradient_sync.hpp"

namespace corpc::ddp {

void GradientSync::State::reset_locked() {
  for (auto& b : buckets) {
    b.ready.assign(b.params.size(), false);
    b.pending = b.params.size();
    b.result.reset();
  }
  next_launch = 0;
  launched_early = 0;
}

// Collectives must be issued in the same order on every rank: launch strictly in bucket order.
void GradientSync::State::launch_ready_locked() {
  while (next_launch < buckets.size() && buckets[next_launch].pending == 0) {
    auto& b = buckets[next_launch];
    if (builtin_allreduce()) {
      std::vector<at::Tensor> tensors{b.flat};
      b.result = group->allreduce(tensors)->getFuture();
    } else {
      b.result = options.comm_hook(*group, GradBucket{b.flat, next_launch, divisor});
    }
    ++next_launch;
  }
}

// Parameter i's gradient so far: in .grad, or in the distributed autograd context of this pass.
at::Tensor GradientSync::State::current_grad(size_t i) const {
  return pass_context >= 0 ? dist_autograd::leaf_hooks::gradient(pass_context, params[i]) : params[i].grad();
}

// Puts parameter k of bucket b's gradient (zero if it has none) into its bucket.
void GradientSync::State::fill_slot_locked(Bucket& b, size_t k) {
  auto& p = params[b.params[k]];
  const auto grad = current_grad(b.params[k]);
  torch::NoGradGuard no_grad;
  const double scale = 1.0 / static_cast<double>(divisor);
  if (views_in_use() && is_bucket_view(grad, b, k)) {  // backward accumulated in place
    if (builtin_allreduce()) view_of(b, k).mul_(scale);
    return;
  }
  auto view = view_of(b, k);
  if (!grad.defined()) {
    view.zero_();
  } else if (builtin_allreduce()) {
    at::mul_out(view, grad, at::scalar_tensor(scale, at::TensorOptions().dtype(at::kDouble)));
  } else {
    view.copy_(grad);
  }
  // From now on backward accumulates into the bucket (AccumulateGrad adds in place to a defined .grad).
  if (views_in_use()) p.mutable_grad() = view;
}

void GradientSync::State::mark_ready_locked(size_t i) {
  const auto [bi, k] = slots[i];
  auto& b = buckets[bi];
  if (b.ready[k]) return;
  fill_slot_locked(b, k);
  b.ready[k] = true;
  --b.pending;
}

// Waits for bucket bi's average; throws DDP's error (naming the bucket and this rank) if the collective failed.
at::Tensor GradientSync::State::wait_bucket_locked(size_t bi) {
  auto& b = buckets[bi];
  b.result->wait();
  if (b.result->hasError()) {
    const std::string why = b.result->tryRetrieveErrorMessage();
    reset_locked();
    in_backward = false;
    // Named as the user names workers: a bare group rank read as the rank that failed, which it need not be.
    std::string here = "rank " + std::to_string(group->getRank()) + " of the process group";
    if (const auto* rpc = Runtime::try_get()) {
      const WorkerInfo me = rpc->worker(rpc->rank());
      here = "worker '" + me.name + "' (RPC rank " + std::to_string(me.rank) + ", " + here + ")";
    }
    throw RpcError("DDP: gradient allreduce of bucket " + std::to_string(bi) + " failed here, on " + here +
                   " (a peer died or timed out?): " + why);
  }
  const auto value = b.result->value();
  b.result.reset();
  return value.isTensor() ? value.toTensor() : value.toTensorVector()[0];
}

void GradientSync::State::finish_backward() {
  std::lock_guard<std::mutex> lock(mutex);
  launch_rest_locked();
  write_back_locked();
}

void GradientSync::State::launch_rest_locked() {
  torch::NoGradGuard no_grad;
  // Parameters this backward did not reach count as zero gradient, so every bucket's allreduce takes place.
  for (auto& b : buckets) {
    if (b.pending == 0) continue;
    for (size_t k = 0; k < b.params.size(); ++k) {
      if (b.ready[k]) continue;
      fill_slot_locked(b, k);
      b.ready[k] = true;
    }
    b.pending = 0;
  }
  launch_ready_locked();
}

void GradientSync::State::write_back_locked() {
  torch::NoGradGuard no_grad;
  for (size_t bi = 0; bi < buckets.size(); ++bi) {
    auto& b = buckets[bi];
    const at::Tensor averaged = wait_bucket_locked(bi);
    if (pass_context >= 0) {
      // The context keeps what it is given: a copy, since the bucket is reused by the next backward.
      for (size_t k = 0; k < b.params.size(); ++k) {
        auto& p = params[b.params[k]];
        dist_autograd::leaf_hooks::set_gradient(pass_context, p,
                                                averaged.narrow(0, b.offsets[k], p.numel()).view(p.sizes()).clone());
      }
      continue;
    }
    if (views_in_use()) {
      // allreduce_hook averages in place: then the gradients already hold their averages.
      if (averaged.data_ptr() != b.flat.data_ptr()) b.flat.copy_(averaged);
      for (size_t k = 0; k < b.params.size(); ++k) {
        auto& p = params[b.params[k]];
        if (!is_bucket_view(p.grad(), b, k)) p.mutable_grad() = view_of(b, k);
      }
      continue;
    }
    for (size_t k = 0; k < b.params.size(); ++k) {
      auto& p = params[b.params[k]];
      auto part = averaged.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(part);
      } else {
        p.mutable_grad() = part.clone();
      }
    }
  }
  in_backward = false;
}

void GradientSync::launch_all() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.reset_locked();
  s.launch_rest_locked();
}

void GradientSync::finish_launched() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.write_back_locked();
}

}  // namespace corpc::ddp
