// Frames with tensors bound for CUDA devices (Route::on_devices): the tensors are copied there on the devices'
// transfer streams, and the frame is dispatched again from the copies' completion, on its connection's I/O thread.
// A failure answers a request with an error, or fails the call a reply was for.
#include "memory/cuda_ipc.hpp"
#include "memory/cuda_transfer.hpp"
#include "memory/device_transfer.hpp"
#include "rpc/call_engine.hpp"
#include "rpc/runtime_impl.hpp"

namespace corpc::detail {

namespace {

void deliver_on_devices(Runtime::Impl& rt, const std::shared_ptr<Connection>& conn, Message&& msg) {
  // A request's share of the receive budget stays reserved until it is delivered.
  auto credit = std::make_shared<ReceiveCredit>(conn->take_receive_credit());
  auto transfer = std::make_shared<DeviceTransfer>();
  auto held = std::make_shared<Message>(std::move(msg));
  try {
    cuda::upload(held->tensors, held->devices, transfer, held->ipc.get());
  } catch (...) {
    transfer->fail(std::current_exception());
  }
  transfer->seal();
  transfer->then([&rt, conn, held = std::move(held), credit = std::move(credit)](std::exception_ptr error) mutable {
    auto& io = conn->io();  // from a CUDA host function: post, and keep nothing there
    asio::post(io, [&rt, conn = std::move(conn), held = std::move(held), credit = std::move(credit),
                    error = std::move(error)]() mutable {
      held->devices.clear();
      if (held->ipc) {
        // Every copy out of the lender's memory is done (or never started): its tensors may go back. A connection
        // lost meanwhile released them on the lender's side, which may have reused the memory under the copy.
        return_ipc_loans(conn, *held->ipc);
        if (!error && held->ipc->link && held->ipc->link->closed())
          error =
              std::make_exception_ptr(ConnectionError("the connection was lost while a CUDA IPC tensor was copied"));
        held->ipc.reset();
      }
      if (!error) return rt.frames.dispatch(conn, std::move(*held));
      const FrameHeader& h = held->head;
      if (h.kind == FrameKind::Request) {
        rt.requests->refuse(*conn, h, std::move(error), "(delivery to a CUDA device)");
      } else if (RpcSession::of(*conn).outgoing) {
        CallEngine::of(*conn).fail_call(conn, h.id, std::move(error));
      }
    });
  });
}

}  // namespace

void route_device_delivery(FrameDispatcher& frames, Runtime::Impl& rt) {
  frames.on(Route::on_devices,
            [&rt](const std::shared_ptr<Connection>& c, Message&& m) { deliver_on_devices(rt, c, std::move(m)); });
}

}  // namespace corpc::detail
