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

#include "corpc/ddp/ddp.hpp"

namespace corpc::ddp {

CommHook allreduce_hook() {
  return [](c10d::ProcessGroup& group, const at::Tensor& bucket) {
    std::vector<at::Tensor> tensors{bucket};
    auto work = group.allreduce(tensors);
    const double world = group.getSize();
    return work->getFuture()->then(
        [world](c10::ivalue::Future& f) { return c10::IValue(f.value().toTensorVector()[0].div_(world)); },
        c10::TensorType::get());
  };
}

CommHook fp16_compress_hook() {
  return [](c10d::ProcessGroup& group, const at::Tensor& bucket) {
    const double world = group.getSize();
    std::vector<at::Tensor> tensors{bucket.div(world).to(at::kHalf)};  // divide first: the sum stays in range
    auto work = group.allreduce(tensors);
    const auto dtype = bucket.scalar_type();
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
  std::vector<bool> unused;   // find_unused_parameters: not reachable from the last forward's output

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

  at::Tensor view_of(const Bucket& b, size_t k) const {
    const auto& p = params[b.params[k]];
    return b.flat.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
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
      auto& b = buckets[next_launch++];
      b.result = options.comm_hook(*group, b.flat);
    }
  }

  void on_grad_ready(size_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!sync) return;
    if (!in_backward) {
      in_backward = true;
      reset_locked();
      for (size_t j = 0; j < unused.size(); ++j) {
        if (unused[j]) mark_ready_locked(j);
      }
      std::weak_ptr<State> weak = weak_from_this();
      torch::autograd::Engine::get_default_engine().queue_callback([weak] {
        if (auto self = weak.lock()) self->finish_backward();
      });
    }
    mark_ready_locked(i);
    const size_t before = next_launch;
    launch_ready_locked();
    launched_early += next_launch - before;
  }

  // Copies parameter i's gradient (zero if it has none) into its bucket.
  void mark_ready_locked(size_t i) {
    const auto [bi, k] = slots[i];
    auto& b = buckets[bi];
    if (b.ready[k]) return;
    const auto& grad = params[i].grad();
    torch::NoGradGuard no_grad;
    if (grad.defined()) {
      view_of(b, k).copy_(grad);
    } else {
      view_of(b, k).zero_();
    }
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

  void finish_backward() {
    std::lock_guard<std::mutex> lock(mutex);
    torch::NoGradGuard no_grad;
    // Parameters this backward did not reach count as zero gradient, so every bucket's allreduce takes place.
    for (auto& b : buckets) {
      if (b.pending == 0) continue;
      for (size_t k = 0; k < b.params.size(); ++k) {
        if (b.ready[k]) continue;
        const auto& grad = params[b.params[k]].grad();
        if (grad.defined()) {
          view_of(b, k).copy_(grad);
        } else {
          view_of(b, k).zero_();
        }
        b.ready[k] = true;
      }
      b.pending = 0;
    }
    launch_ready_locked();
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      auto& b = buckets[bi];
      b.result->wait();
      if (b.result->hasError()) {
        const std::string why = b.result->tryRetrieveErrorMessage();
        reset_locked();
        in_backward = false;
        throw std::runtime_error("DDP: gradient allreduce of bucket " + std::to_string(bi) + " failed on rank " +
                                 std::to_string(group->getRank()) + " (a peer died or timed out?): " + why);
      }
      const auto value = b.result->value();
      const at::Tensor averaged = value.isTensor() ? value.toTensor() : value.toTensorVector()[0];
      for (size_t k = 0; k < b.params.size(); ++k) {
        auto& p = params[b.params[k]];
        auto part = averaged.narrow(0, b.offsets[k], p.numel()).view(p.sizes());
        if (p.grad().defined()) {
          p.mutable_grad().copy_(part);
        } else {
          p.mutable_grad() = part.clone();
        }
      }
      b.result.reset();
    }
    in_backward = false;
  }

  void broadcast(std::vector<at::Tensor>& tensors) {
    torch::NoGradGuard no_grad;
    for (auto& t : tensors) {
      std::vector<at::Tensor> one{t.detach()};
      group->broadcast(one)->wait();
    }
  }
};

GradientSync::GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.group = std::move(group);
  s.options = std::move(options);
  if (!s.options.comm_hook) s.options.comm_hook = allreduce_hook();
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

  std::weak_ptr<State> weak = state_;
  for (size_t i = 0; i < s.params.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(s.params[i]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [weak, i](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
          if (auto self = weak.lock()) self->on_grad_ready(i);
          return outputs;
        }));
    s.accumulators.push_back(std::move(acc));
  }
}

GradientSync::~GradientSync() = default;

void GradientSync::before_forward() {
  if (state_->options.broadcast_buffers && !state_->buffers.empty() && state_->group->getSize() > 1) {
    state_->broadcast(state_->buffers);
  }
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
