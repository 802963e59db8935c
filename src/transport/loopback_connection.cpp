// The connection of a worker to itself: each frame comes back to the frame handler as if received, through a copy of
// its tensors, so that a self-call has exactly the semantics of a remote one.
#include <ATen/ATen.h>

#include <cstring>

#include "transport/connection.hpp"

namespace corpc::detail {

namespace {

class LoopbackConnection final : public Connection {
 public:
  LoopbackConnection(asio::io_context& io, WireLimits limits, FrameHandler on_frame, const SessionFactory& make_session)
      : Connection(io, make_session), limits_(limits), on_frame_(std::move(on_frame)) {
    peer_limits = limits;
  }

  void send(OutFrame&& f) override {
    // Same semantics as the wire: the receiver gets its own copy of every tensor, detached, requires_grad kept.
    Message msg;
    msg.head = f.head;
    msg.body = std::move(f.body);
    if (f.head.num_tensors) {
      msg.tensors = decode_tensor_meta(f.meta.data(), f.meta.size(), f.head.num_tensors, f.head.tensor_bytes, limits_,
                                       &msg.devices);
      for (std::size_t i = 0; i < msg.tensors.size(); ++i)
        if (msg.tensors[i].nbytes())
          std::memcpy(msg.tensors[i].data_ptr(), f.tensors[i].data_ptr(),
                      static_cast<std::size_t>(f.tensors[i].nbytes()));
    }
    asio::post(io(), [self = shared_from_this(), msg = std::move(msg)]() mutable {
      auto* me = static_cast<LoopbackConnection*>(self.get());
      if (!me->on_frame_) return;
      DispatchBatch batch(me->io());
      me->on_frame_(self, std::move(msg));
    });
  }
  void close(std::string) override {
    asio::post(io(),
               [self = shared_from_this()] { static_cast<LoopbackConnection*>(self.get())->on_frame_ = nullptr; });
  }
  void close_when_flushed() override { close({}); }

 private:
  WireLimits limits_;
  FrameHandler on_frame_;
};

}  // namespace

std::shared_ptr<Connection> make_loopback_connection(asio::io_context& io, WireLimits limits, FrameHandler on_frame,
                                                     const SessionFactory& make_session) {
  return std::make_shared<LoopbackConnection>(io, limits, std::move(on_frame), make_session);
}

}  // namespace corpc::detail
