// GradientSync: buckets, accumulator hooks, overlapped allreduce, and the end-of-backward wait (see ddp.hpp).
//
// Built from c10d's ProcessGroup collectives and autograd's public-internal hooks rather than c10d::Reducer: the
// Reducer's C++ constructor wants Python-side bucket assignment and logger plumbing, and the pieces below are what
// it does for the dense, single-device-per-parameter case.
#include <algorithm>
#include <mutex>
#include <unordered_set>
#include <stdexcept>
#include <vector>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "corpc/autograd/dist_autograd.hpp"
#include "corpc/ddp/ddp.hpp"
#include "corpc/rpc/errors.hpp"

namespace corpc::ddp {

CommHook allreduce_hook() {
  return [](c10d::ProcessGroup& group, const GradBucket& bucket) {
    std::vector<at::Tensor> tensors{bucket.buffer};
    auto work = group.allreduce(tensors);
    const double divisor = static_cast<double>(bucket.divisor);
    return work->getFuture()->then(
        [divisor](c10::ivalue::Future& f) { return c10::IValue(f.value().toTensorVector()[0].div_(divisor)); },
        c10::TensorType::get());
  };
}

CommHook fp16_compress_hook() {
  return [](c10d::ProcessGroup& group, const GradBucket& bucket) {
    // Divide first: the sum stays in float16's range.
    std::vector<at::Tensor> tensors{bucket.buffer.div(static_cast<double>(bucket.divisor)).to(at::kHalf)};
    auto work = group.allreduce(tensors);
    const auto dtype = bucket.buffer.scalar_type();
    return work->getFuture()->then(
        [dtype](c10::ivalue::Future& f) { return c10::IValue(f.value().toTensorVector()[0].to(dtype)); },
        c10::TensorType::get());
  };
}

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
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;  // kept alive: autograd holds them weakly

  mutable std::mutex mutex;
  bool sync = true;
  bool in_backward = false;
  size_t next_launch = 0;
  size_t launched_early = 0;  // of the current / last backward
  // The distributed autograd context whose backward pass this is (its gradients live there, not in .grad), or -1.
  std::int64_t pass_context = -1;
  std::vector<bool> unused;   // find_unused_parameters: not reachable from the last forward's output

  // Join (uneven inputs): see ddp.hpp.
  bool joining = false;
  JoinOptions join_options;
  int64_t divisor = 1;           // of the current step's gradients
  int64_t source_rank = 0;       // buffers come from here: the highest rank still training
  int64_t last_source_rank = -1; // source_rank of the last step any rank trained in

  void build_buckets() {
    const double cap_bytes = options.bucket_cap_mb * 1024 * 1024;
    // Reverse registration order: backward reaches the last layers first.
    for (size_t i = params.size(); i-- > 0;) {
      const auto& p = params[i];
      bool fresh = buckets.empty();
      if (!fresh) {
        auto& b = buckets.back();
        const auto& first = params[b.params.front()];
        const double bytes = static_cast<double>(b.offsets.back() + params[b.params.back()].numel()) *
                             static_cast<double>(first.element_size());
        // As PyTorch: the first bucket (the last layers, ready first) is small, so communication starts early.
        const double cap = buckets.size() == 1 ? std::min(cap_bytes, 1024.0 * 1024.0) : cap_bytes;
        fresh = bytes >= cap || first.scalar_type() != p.scalar_type() || first.device() != p.device();
      }
      if (fresh) buckets.emplace_back();
      auto& b = buckets.back();
      const int64_t offset = b.params.empty() ? 0 : b.offsets.back() + params[b.params.back()].numel();
      slots[i] = Slot{buckets.size() - 1, b.params.size()};
      b.params.push_back(i);
      b.offsets.push_back(offset);
    }
    for (auto& b : buckets) {
      const auto& last = params[b.params.back()];
      b.flat = at::zeros({b.offsets.back() + last.numel()}, last.options());
      b.ready.assign(b.params.size(), false);
    }
  }

  // Parameter k of bucket b's slice of the flat buffer. Made with set_ on the buffer's storage rather than
  // narrow/view so that it carries no autograd view metadata: as a `.grad` it must survive zero_grad's detach_().
  at::Tensor view_of(const Bucket& b, size_t k) const {
    const auto& p = params[b.params[k]];
    std::vector<int64_t> strides(p.dim(), 1);
    for (int64_t d = p.dim() - 1; d > 0; --d) strides[d - 1] = strides[d] * p.size(d);
    return at::empty({0}, b.flat.options()).set_(b.flat.storage(), b.flat.storage_offset() + b.offsets[k], p.sizes(),
                                                 strides);
  }

  bool is_bucket_view(const at::Tensor& grad, const Bucket& b, size_t k) const {
    return grad.defined() && grad.is_alias_of(b.flat) &&
           grad.storage_offset() == b.flat.storage_offset() + b.offsets[k] && grad.is_contiguous();
  }

  void reset_locked() {
    for (auto& b : buckets) {
      b.ready.assign(b.params.size(), false);
      b.pending = b.params.size();
      b.result.reset();
    }
    next_launch = 0;
    launched_early = 0;
  }

  // Collectives must be issued in the same order on every rank: launch strictly in bucket order.
  void launch_ready_locked() {
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

  void on_grad_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync) return;
    if (!in_backward) {
      in_backward = true;
      pass_context = dist_autograd::leaf_hooks::pass_context_id();
      reset_locked();
      for (size_t j = 0; j < unused.size(); ++j) {
        if (unused[j]) mark_ready_locked(j);
      }
      std::weak_ptr<State> weak = weak_from_this();
      auto finish = [weak] {
        if (auto self = weak.lock()) self->finish_backward();
      };
      if (pass_context >= 0) {
        dist_autograd::leaf_hooks::at_end_of_pass(std::move(finish));
      } else {
        torch::autograd::Engine::get_default_engine().queue_callback(std::move(finish));
      }
    }
    mark_ready_locked(i);
    const size_t before = next_launch;
    launch_ready_locked();
    launched_early += next_launch - before;
  }

  bool views_in_use() const { return options.gradient_as_bucket_view && pass_context < 0; }

  // Parameter i's gradient so far: in .grad, or in the distributed autograd context of this pass.
  at::Tensor current_grad(size_t i) const {
    return pass_context >= 0 ? dist_autograd::leaf_hooks::gradient(pass_context, params[i]) : params[i].grad();
  }

  // The default hook (none given): the gradients are divided on their way into the bucket, and the bucket's
  // allreduce is the whole hook. One pass over the gradients less than dividing the sum afterwards (PyTorch does
  // the same); for N ranks the sum of g_i / N rounds differently from (sum g_i) / N only when N is not a power of 2.
  bool builtin_allreduce() const { return !options.comm_hook; }

  // Puts parameter k of bucket b's gradient (zero if it has none) into its bucket.
  void fill_slot_locked(Bucket& b, size_t k) {
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

  void mark_ready_locked(size_t i) {
    const auto [bi, k] = slots[i];
    auto& b = buckets[bi];
    if (b.ready[k]) return;
    fill_slot_locked(b, k);
    b.ready[k] = true;
    --b.pending;
  }

  // PyTorch's find_unused_parameters: walk the autograd graph from the output; parameters whose accumulator is not
  // on it will get no gradient in this backward, so their buckets need not wait for them.
  void find_unused(const at::Tensor& output) {
    std::unordered_set<torch::autograd::Node*> seen;
    std::vector<torch::autograd::Node*> stack;
    if (output.grad_fn()) {
      stack.push_back(output.grad_fn().get());
      seen.insert(stack.back());
    }
    while (!stack.empty()) {
      auto* node = stack.back();
      stack.pop_back();
      for (const auto& edge : node->next_edges()) {
        if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    unused.assign(params.size(), false);
    for (size_t i = 0; i < params.size(); ++i) unused[i] = seen.count(accumulators[i].get()) == 0;
  }

  // Waits for bucket bi's average; throws DDP's error (naming the bucket and this rank) if the collective failed.
  at::Tensor wait_bucket_locked(size_t bi) {
    auto& b = buckets[bi];
    b.result->wait();
    if (b.result->hasError()) {
      const std::string why = b.result->tryRetrieveErrorMessage();
      reset_locked();
      in_backward = false;
      throw RpcError("DDP: gradient allreduce of bucket " + std::to_string(bi) + " failed on rank " +
                               std::to_string(group->getRank()) + " (a peer died or timed out?): " + why);
    }
    const auto value = b.result->value();
    b.result.reset();
    return value.isTensor() ? value.toTensor() : value.toTensorVector()[0];
  }

  void finish_backward() {
    std::lock_guard<std::mutex> lock(mutex);
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

  // One broadcast per dtype and device, of the tensors flattened together (as PyTorch's coalesced broadcast):
  // ResNet-18's 60 BatchNorm buffers cost two round trips before each forward instead of sixty.
  void broadcast(std::vector<at::Tensor>& tensors, int64_t root = 0) {
    torch::NoGradGuard no_grad;
    c10d::BroadcastOptions o;
    o.rootRank = root;
    std::vector<bool> done(tensors.size(), false);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (done[i]) continue;
      std::vector<size_t> same;
      std::vector<at::Tensor> flat_parts;
      for (size_t j = i; j < tensors.size(); ++j) {
        if (done[j] || tensors[j].scalar_type() != tensors[i].scalar_type() ||
            tensors[j].device() != tensors[i].device()) {
          continue;
        }
        done[j] = true;
        same.push_back(j);
        flat_parts.push_back(tensors[j].detach().reshape(-1));
      }
      std::vector<at::Tensor> flat{at::cat(flat_parts)};
      group->broadcast(flat, o)->wait();
      int64_t offset = 0;
      for (size_t j : same) {
        auto& t = tensors[j];
        t.detach().copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
        offset += t.numel();
      }
    }
  }

  // Hooks parameter i's gradient accumulator. A parameter's accumulator can change under DDP: loading a checkpoint
  // (InputArchive's set_ on each parameter) gives it a new one, and a hook on the old one would never fire again,
  // leaving that rank training alone. So before each forward the hooks follow the current accumulators.
  void follow_accumulators() {
    std::weak_ptr<State> weak = weak_from_this();
    for (size_t i = 0; i < params.size(); ++i) {
      auto acc = torch::autograd::impl::grad_accumulator(params[i]);
      if (acc == accumulators[i]) continue;
      acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
            if (auto self = weak.lock()) self->on_grad_ready(i);
            return outputs;
          }));
      std::lock_guard<std::mutex> lock(mutex);
      accumulators[i] = std::move(acc);
    }
  }

  // Join: the allreduce every rank makes once per step while a join is open. Returns (ranks training, whether
  // they synchronise gradients this step); sets the divisor and the rank buffers come from.
  std::pair<int64_t, bool> join_vote(bool training, bool wants_sync) {
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

  bool has_buffers_to_broadcast() const {
    return options.broadcast_buffers && !buffers.empty() && group->getSize() > 1;
  }

  // A joined rank's share of one step of the others: what their forward and backward do collectively.
  void shadow_step(bool synchronised) {
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
};

GradientSync::GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.group = std::move(group);
  s.options = std::move(options);
  s.divisor = s.group->getSize();
  for (auto& p : module.parameters()) {
    if (p.requires_grad()) s.params.push_back(p);
  }
  s.buffers = module.buffers();
  s.slots.resize(s.params.size());
  s.build_buckets();

  // Every rank starts from rank 0's model.
  auto all = s.params;
  all.insert(all.end(), s.buffers.begin(), s.buffers.end());
  s.broadcast(all);

  if (s.options.gradient_as_bucket_view) {
    // Gradients that exist already move into their buckets; the others follow at their first backward.
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < s.params.size(); ++i) {
      auto& p = s.params[i];
      if (!p.grad().defined()) continue;
      auto view = s.view_of(s.buckets[s.slots[i].bucket], s.slots[i].index);
      view.copy_(p.grad());
      p.mutable_grad() = view;
    }
  }

  s.accumulators.resize(s.params.size());
  s.follow_accumulators();
}

GradientSync::~GradientSync() = default;

void GradientSync::before_forward() {
  auto& s = *state_;
  s.follow_accumulators();
  if (s.joining) s.join_vote(/*training=*/true, sync_enabled() && at::GradMode::is_enabled());
  if (s.has_buffers_to_broadcast()) s.broadcast(s.buffers, s.source_rank);
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

void GradientSync::after_forward(const at::Tensor& output) {
  if (state_->options.find_unused_parameters && sync_enabled()) state_->find_unused(output);
}

void GradientSync::set_sync(bool enabled) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->sync = enabled;
}

bool GradientSync::sync_enabled() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->sync;
}

size_t GradientSync::bucket_count() const { return state_->buckets.size(); }

size_t GradientSync::buckets_launched_during_last_backward() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->launched_early;
}

}  // namespace corpc::ddp
