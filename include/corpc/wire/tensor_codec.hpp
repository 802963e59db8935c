/// @file
/// Tensors inside arguments and results: encoded as an index into the message's tensor
/// table; their bytes travel out of band (see docs/transfers.md). An undefined tensor round-trips as undefined.
#pragma once

#include <ATen/core/Tensor.h>

#include "corpc/wire/codec.hpp"

namespace corpc {

/// @cond INTERNAL
// Tensors: their index in the message's tensor table (kUndefined for an undefined tensor).
template <>
struct Codec<at::Tensor> {
  static constexpr std::uint32_t kUndefined = 0xffffffffu;
  static void write(Writer& w, const at::Tensor& t) {
    if (!t.defined()) return w.put(kUndefined);
    if (!w.tensors) throw UsageError("tensor encoded outside an RPC message");
    w.put(static_cast<std::uint32_t>(w.tensors->size()));
    w.tensors->push_back(t);
  }
  static at::Tensor read(Reader& r) {
    auto i = r.get<std::uint32_t>();
    if (i == kUndefined) return at::Tensor();
    if (!r.tensors || i >= r.tensors->size())
      throw ProtocolError("tensor index " + std::to_string(i) + " out of range");
    return (*r.tensors)[i];
  }
};
/// @endcond

}  // namespace corpc
