// libFuzzer target: the 72-byte frame header, as the transport validates it before allocating anything it announces.
// Property: validate_header either throws ProtocolError or accepts a header whose every announced size is within the
// limits it was checked against (with the defaults, and with tight limits such as a small RpcOptions::limits).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "corpc/wire/detail/frame.hpp"

namespace {
void check(const corpc::detail::FrameHeader& h, const corpc::WireLimits& lim) {
  try {
    corpc::detail::validate_header(h, lim);
  } catch (const corpc::ProtocolError&) {
    return;
  }
  if (h.body_len > lim.max_body_bytes || h.meta_len > lim.max_meta_bytes || h.num_tensors > lim.max_tensors ||
      h.tensor_bytes > lim.max_tensor_bytes || h.magic != corpc::detail::kFrameMagic ||
      h.version != corpc::detail::kProtocolVersion || h.kind < corpc::detail::FrameKind::Hello ||
      h.kind > corpc::detail::FrameKind::IpcDone)
    std::abort();
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < sizeof(corpc::detail::FrameHeader)) return 0;
  corpc::detail::FrameHeader h;
  std::memcpy(&h, data, sizeof h);
  check(h, corpc::WireLimits{});
  corpc::WireLimits tight;
  tight.max_body_bytes = 4096;
  tight.max_meta_bytes = 256;
  tight.max_tensors = 4;
  tight.max_tensor_bytes = 1 << 20;
  check(h, tight);
  return 0;
}
