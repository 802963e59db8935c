#include "rpc/hello.hpp"

namespace corpc::detail {

std::string encode_hello(const Hello& hello) {
  std::string body;
  Writer w(body);
  w.put(hello.version);
  w.put(hello.self);
  w.put(hello.world_size);
  w.put(hello.registering);
  w.put(hello.limits.max_body_bytes);
  w.put(hello.limits.max_meta_bytes);
  w.put(hello.limits.max_tensors);
  w.put(hello.limits.max_tensor_bytes);
  w.put(hello.limits.max_dims);
  w.put(hello.limits.max_request_bytes);
  w.put(hello.devices);
  w.put(hello.host);
  w.put(hello.shm_socket);
  w.put(hello.shm_cookie);
  w.put(hello.cuda_ipc);
  w.put(hello.rejoining);
  w.put(hello.local);
  w.put(hello.incarnation);
  w.put(hello.public_key);
  w.put(hello.proof);
  w.put(hello.certificate);
  return body;
}

Hello decode_hello(const char* body, std::size_t size) {
  Reader r(body, size);
  Hello h;
  h.version = r.get<std::uint32_t>();
  if (h.version != kProtocolVersion)
    throw ProtocolError("protocol version " + std::to_string(h.version) + " != " + std::to_string(kProtocolVersion));
  h.self = r.get<WorkerInfo>();
  h.world_size = r.get<int>();
  h.registering = r.get<bool>();
  h.limits.max_body_bytes = r.get<std::uint32_t>();
  h.limits.max_meta_bytes = r.get<std::uint32_t>();
  h.limits.max_tensors = r.get<std::uint32_t>();
  h.limits.max_tensor_bytes = r.get<std::uint64_t>();
  h.limits.max_dims = r.get<std::uint32_t>();
  h.limits.max_request_bytes = r.get<std::uint64_t>();
  h.devices = r.get<std::string>();
  h.host = r.get<std::string>();
  h.shm_socket = r.get<std::string>();
  h.shm_cookie = r.get<std::string>();
  h.cuda_ipc = r.get<bool>();
  h.rejoining = r.get<bool>();
  h.local = r.get<LocalAddress>();
  h.incarnation = r.get<std::uint32_t>();
  h.public_key = r.get<std::string>();
  h.proof = r.get<std::string>();
  h.certificate = r.get<std::string>();
  return h;
}

}  // namespace corpc::detail
