// libFuzzer target: the Hello body (the handshake after authentication: who the peer says it is, its world size,
// the limits it accepts, its device configuration, its host's identity, same-host channel offer, CUDA IPC, whether it
// rejoins, and its Unix socket for peers on its host). Property: decode_hello throws
// ProtocolError or returns a Hello that re-encodes to exactly the bytes it consumed and decodes again to the same Hello.
#include <cstdint>
#include <cstdlib>

#include "rpc/hello.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  corpc::detail::Hello h;
  try {
    h = corpc::detail::decode_hello(reinterpret_cast<const char*>(data), size);
  } catch (const corpc::ProtocolError&) {
    return 0;
  }
  const std::string again = corpc::detail::encode_hello(h);
  if (again.size() > size || again.compare(0, again.size(), reinterpret_cast<const char*>(data), again.size()) != 0)
    std::abort();
  const auto h2 = corpc::detail::decode_hello(again.data(), again.size());
  if (!(h2.self == h.self) || h2.world_size != h.world_size || h2.registering != h.registering ||
      h2.limits.max_tensor_bytes != h.limits.max_tensor_bytes || h2.devices != h.devices || h2.host != h.host ||
      h2.shm_socket != h.shm_socket || h2.shm_cookie != h.shm_cookie || h2.cuda_ipc != h.cuda_ipc ||
      h2.rejoining != h.rejoining || !(h2.local == h.local))
    std::abort();
  return 0;
}
