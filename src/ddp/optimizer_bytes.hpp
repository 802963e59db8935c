// An optimizer's state as one byte tensor (its archive, serialised) and back: how a recovering member receives a
// donor's optimizer state, and how a replica checkpoint stores a stage's. Made, the bytes are a copy: the optimizer's
// own archive would hold its live state tensors.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <sstream>
#include <string>

namespace corpc::ddp::detail {

inline at::Tensor optimizer_bytes(torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string b = bytes.str();
  at::Tensor out = at::empty({static_cast<std::int64_t>(b.size())}, at::kByte);
  if (!b.empty()) std::memcpy(out.data_ptr(), b.data(), b.size());
  return out;
}

// The archive that optimizer.load() takes, from what optimizer_bytes made.
inline torch::serialize::InputArchive optimizer_archive(const at::Tensor& bytes) {
  std::istringstream stream(
      std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(bytes.numel())));
  torch::serialize::InputArchive archive;
  archive.load_from(stream);
  return archive;
}

}  // namespace corpc::ddp::detail
