// corpc/wire/detail/frame.hpp — the framing of every message on a corpc connection (internal).
//
// ```
//   FrameHeader (72 bytes) | tensor metadata (meta_len) | body (body_len) | tensor data (tensor_bytes, one blob each)
// ```
//
// The header is typed: what the runtime routes on (kind, request id, function id, argument signature, distributed
// autograd ids, deadline, flags) travels as fixed fields, so a request is dispatched without parsing its body and a
// function name never travels except in errors and by-name registrations. The header is validated against
// WireLimits before anything it announces is allocated; senders check the receiver's limits (announced in Hello)
// before they send. Tensor data follows the body so that the sender gathers it straight from tensor storage and the
// receiver reads it straight into new storage. Fields are little-endian (every supported host is).
#pragma once

#include <cstdint>
#include <string>

#include "corpc/wire/errors.hpp"
#include "corpc/wire/limits.hpp"

namespace corpc::detail {

inline constexpr std::uint32_t kFrameMagic = 0x43505243;  // "CRPC"
// Ranks talk only to ranks of the same version; it is also the minor version of corpc (meson.build reads it here).
// What each version changed: docs/CHANGES.md#wire-protocol-versions.
inline constexpr std::uint8_t kProtocolVersion = 10;

// What a frame is (FrameHeader::kind).
enum class FrameKind : std::uint8_t {
  Hello = 1,     // first frame from a dialer: who I am, my limits (also the rendezvous registration)
  World = 2,     // rendezvous answer from rank 0: every worker's address
  Request = 3,   // a call; id = the caller's request id on this connection
  Response = 4,  // a successful result for request `id` of this connection
  Error = 5,     // a failure for request `id` (id 0: the connection itself was refused)
  Goodbye = 6,   // orderly close: the peer is leaving on purpose
  Ping = 7,      // heartbeat of a quiet connection: answer with Pong (no payload; handled by the transport)
  Pong = 8,      // the answer to a Ping
  IpcDone = 9,   // the receiver of CUDA tensors lent by CUDA IPC is done copying them: the body lists their loans
};

// Header flags (FrameHeader::flags).
inline constexpr std::uint16_t kFlagControl = 1;  // corpc's own bookkeeping: graceful shutdown does not count it
inline constexpr std::uint16_t kFlagCancel = 2;   // with Request: stop request `id` of this connection (no reply)
// The tensor data is not on the socket but in the connection's same-host ring, at the position held in the last 8
// bytes of the tensor metadata (meta_len counts them); tensor_bytes still says how much there is.
inline constexpr std::uint16_t kFlagShm = 4;

// The fixed 72-byte header that starts every frame (layout at the top of this file), sent as these bytes.
struct FrameHeader {
  std::uint32_t magic = kFrameMagic;        // kFrameMagic, or the connection is not a corpc peer
  std::uint8_t version = kProtocolVersion;  // must equal kProtocolVersion
  FrameKind kind = FrameKind::Request;      // what the frame is
  std::uint16_t flags = 0;                  // kFlagControl, kFlagCancel
  std::uint32_t meta_len = 0;               // tensor metadata bytes
  std::uint32_t body_len = 0;               // codec bytes
  std::uint32_t num_tensors = 0;            // entries in the tensor metadata
  std::uint32_t deadline_ms = 0;   // Request: the caller's remaining budget in ms, relative (clocks need not agree)
  std::uint64_t id = 0;            // request id, chosen by the caller, echoed by Response/Error
  std::uint64_t function = 0;      // Request: function id (fnv1a of its registered name)
  std::uint64_t signature = 0;     // Request: hash of the argument types; 0 accepts anything
  std::int64_t context_id = -1;    // distributed autograd context of the sender (-1: none)
  std::int64_t message_id = -1;    // distributed autograd send/recv pairing (-1: none)
  std::uint64_t tensor_bytes = 0;  // sum of the tensors' data
};
static_assert(sizeof(FrameHeader) == 72);

// What a frame with header `h` weighs on the wire.
inline std::uint64_t frame_bytes(const FrameHeader& h) noexcept {
  return sizeof h + std::uint64_t{h.meta_len} + h.body_len + h.tensor_bytes;
}

// Throws ProtocolError if `h` is not a corpc header of this version or announces more than `lim` allows; checked on
// every received header before anything it announces is allocated.
inline void validate_header(const FrameHeader& h, const WireLimits& lim) {
  if (h.magic != kFrameMagic) throw ProtocolError("bad frame magic (not a corpc peer?)");
  if (h.version != kProtocolVersion)
    throw ProtocolError("protocol version " + std::to_string(h.version) + " != ours " +
                        std::to_string(kProtocolVersion));
  if (h.kind < FrameKind::Hello || h.kind > FrameKind::IpcDone)
    throw ProtocolError("unknown frame kind " + std::to_string(static_cast<int>(h.kind)));
  if (h.body_len > lim.max_body_bytes)
    throw ProtocolError("frame body of " + std::to_string(h.body_len) + " bytes over the limit");
  if (h.meta_len > lim.max_meta_bytes)
    throw ProtocolError("tensor metadata of " + std::to_string(h.meta_len) + " bytes over the limit");
  if (h.num_tensors > lim.max_tensors) throw ProtocolError(std::to_string(h.num_tensors) + " tensors over the limit");
  if (h.tensor_bytes > lim.max_tensor_bytes)
    throw ProtocolError("tensor data of " + std::to_string(h.tensor_bytes) + " bytes over the limit");
}

}  // namespace corpc::detail
