// GradientSync: the comm hooks, construction, the coalesced broadcast, and the calls around forward (see ddp.hpp; the
// state and where each of its parts lives: gradient_sync.hpp).
//
// Built from c10d's ProcessGroup collectives and autograd's public-internal hooks rather than c10d::Reducer: the
// Reducer's C++ constructor wants Python-side bucket assignment and logger plumbing, and the pieces of
// gradient_sync.hpp are what it does for the dense, single-device-per-parameter case.
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "core/log.hpp"
#include "ddp/gradient_sync.hpp"

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
  // Whether the group's backend reduces float16 is asked once, with a one-element allreduce that every rank makes at
  // the same point (its first bucket): Debian's libtorch 2.14 builds Gloo without half types (its allreduce fails with
  // "Invalid scalar type", as PyTorch's own dist.all_reduce of float16 does there), and a hook that failed every step
  // would stop training. There the buckets are reduced uncompressed, in their own dtype, as allreduce_hook() does, and
  // a warning says so.
  auto half_reduces = std::make_shared<std::optional<bool>>();
  return [half_reduces, uncompressed = allreduce_hook()](c10d::ProcessGroup& group, const GradBucket& bucket) {
    if (!half_reduces->has_value()) {
      std::vector<at::Tensor> probe{at::zeros({1}, at::kHalf)};
      try {
        group.allreduce(probe)->wait();
        *half_reduces = true;
      } catch (const std::exception& e) {
        const std::string_view what = e.what();
        if (what.find("Invalid scalar type") == std::string_view::npos) throw;
        *half_reduces = false;
        corpc::detail::log(corpc::detail::LogLevel::warn, "ddp", "fp16_compress_hook",
                           "this process group's backend cannot reduce float16 tensors ({}): buckets are reduced "
                           "uncompressed, in {}",
                           what.substr(0, what.find('\n')), c10::toString(bucket.buffer.scalar_type()));
      }
    }
    if (!**half_reduces) return uncompressed(group, bucket);
    // Divide first: the sum stays in float16's range.
    std::vector<at::Tensor> tensors{bucket.buffer.div(static_cast<double>(bucket.divisor)).to(at::kHalf)};
    auto work = group.allreduce(tensors);
    const auto dtype = bucket.buffer.scalar_type();
    return work->getFuture()->then(
        [dtype](c10::ivalue::Future& f) { return c10::IValue(f.value().toTensorVector()[0].to(dtype)); },
        c10::TensorType::get());
  };
}

// One broadcast per dtype and device, of the tensors flattened together (as PyTorch's coalesced broadcast):
// ResNet-18's 60 BatchNorm buffers cost two round trips before each forward instead of sixty.
void GradientSync::State::broadcast(std::vector<at::Tensor>& tensors, int64_t root) {
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

namespace {

// What both constructors do: the parameters that require a gradient, the buffers, the buckets.
std::shared_ptr<GradientSync::State> make_state(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                DdpOptions options) {
  auto state = std::make_shared<GradientSync::State>();
  auto& s = *state;
  s.group = std::move(group);
  s.options = std::move(options);
  s.divisor = s.group->getSize();
  for (auto& p : module.parameters()) {
    if (p.requires_grad()) s.params.push_back(p);
  }
  s.buffers = module.buffers();
  s.slots.resize(s.params.size());
  s.build_buckets();
  return state;
}

}  // namespace

GradientSync::GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options,
                           Manual)
    : state_(make_state(module, std::move(group), std::move(options))) {
  state_->options.gradient_as_bucket_view = false;  // .grad is written only once the averages are in
}

GradientSync::GradientSync(torch::nn::Module& module, c10::intrusive_ptr<c10d::ProcessGroup> group, DdpOptions options)
    : state_(make_state(module, std::move(group), std::move(options))) {
  auto& s = *state_;

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
