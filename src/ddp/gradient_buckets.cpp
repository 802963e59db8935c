// Buckets: which parameters' gradients travel together, and views of a bucket's flat buffer in a parameter's shape.
#include "ddp/gradient_sync.hpp"

namespace corpc::ddp {

void GradientSync::State::build_buckets() {
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
at::Tensor GradientSync::State::view_of(const Bucket& b, size_t k) const {
  const auto& p = params[b.params[k]];
  std::vector<int64_t> strides(p.dim(), 1);
  for (int64_t d = p.dim() - 1; d > 0; --d) strides[d - 1] = strides[d] * p.size(d);
  return at::empty({0}, b.flat.options())
      .set_(b.flat.storage(), b.flat.storage_offset() + b.offsets[k], p.sizes(), strides);
}

bool GradientSync::State::is_bucket_view(const at::Tensor& grad, const Bucket& b, size_t k) const {
  return grad.defined() && grad.is_alias_of(b.flat) &&
         grad.storage_offset() == b.flat.storage_offset() + b.offsets[k] && grad.is_contiguous();
}

}  // namespace corpc::ddp
