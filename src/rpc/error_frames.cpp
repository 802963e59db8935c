// Error frames: how a failure travels back to the caller as a typed exception.
#include "rpc/error_frames.hpp"

#include <cxxabi.h>

#include <cstdlib>
#include <memory>

#include "corpc/rpc/errors.hpp"
#include "corpc/wire/codec.hpp"
#include "corpc/wire/errors.hpp"

#include "core/trace_recorder.hpp"

namespace corpc {

namespace {

// [u8 code][worker][function][type][message]
enum class ErrorCode : std::uint8_t { Remote = 1, UnknownFunction, ArgumentType, Protocol, Shutdown, TooLarge };

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> out(abi::__cxa_demangle(name, nullptr, nullptr, &status), std::free);
  return status == 0 && out ? std::string(out.get()) : std::string(name);
}

std::string current_exception_type() {
  auto* t = abi::__cxa_current_exception_type();
  return t ? demangle(t->name()) : "unknown";
}

}  // namespace

detail::Message error_frame(std::uint64_t id, std::exception_ptr error, const std::string& worker,
                            std::string_view function) {
  ErrorCode code = ErrorCode::Remote;
  std::string type, message;
  try {
    std::rethrow_exception(error);
  } catch (const UnknownFunctionError& e) {
    code = ErrorCode::UnknownFunction, type = "corpc::UnknownFunctionError", message = e.what();
  } catch (const ArgumentTypeError& e) {
    code = ErrorCode::ArgumentType, type = "corpc::ArgumentTypeError", message = e.what();
  } catch (const ProtocolError& e) {
    code = ErrorCode::Protocol, type = "corpc::ProtocolError", message = e.what();
  } catch (const MessageTooLargeError& e) {
    code = ErrorCode::TooLarge, type = "corpc::MessageTooLargeError", message = e.what();
  } catch (const std::exception& e) {
    type = current_exception_type(), message = e.what();
  } catch (...) {
    type = current_exception_type(), message = "non-standard exception";
  }
  detail::Message m;
  m.head.kind = detail::FrameKind::Error;
  m.head.id = id;
  Writer w(m.body);
  w.put(static_cast<std::uint8_t>(code));
  w.put(worker);
  w.put(std::string(function));
  w.put(type);
  w.put(message);
  return m;
}

std::exception_ptr decode_error(const detail::Message& msg, const std::string& worker, std::string_view function) {
  try {
    Reader r(msg.body.data(), msg.body.size());
    auto code = static_cast<ErrorCode>(r.get<std::uint8_t>());
    auto remote_worker = r.get<std::string>();
    auto fn = r.get<std::string>();
    auto type = r.get<std::string>();
    auto message = r.get<std::string>();
    if (fn.empty()) fn = std::string(function);  // the callee did not know the name (only its id travels)
    switch (code) {
      case ErrorCode::UnknownFunction:
        return std::make_exception_ptr(UnknownFunctionError("no function '" + std::string(function) +
                                                            "' is registered on worker '" + remote_worker +
                                                            "' (different binaries? register it by name)"));
      case ErrorCode::ArgumentType: return std::make_exception_ptr(ArgumentTypeError(message));
      case ErrorCode::Protocol: return std::make_exception_ptr(ProtocolError(message));
      case ErrorCode::Shutdown: return std::make_exception_ptr(ShutdownError(message));
      case ErrorCode::TooLarge: return std::make_exception_ptr(MessageTooLargeError(message));
      default: return std::make_exception_ptr(RemoteError(remote_worker, fn, type, message));
    }
  } catch (const ProtocolError& e) {
    return std::make_exception_ptr(
        ProtocolError("malformed error reply from '" + worker + "' for '" + std::string(function) + "': " + e.what()));
  }
}

void send_error_frame(detail::Connection& conn, std::uint64_t id, std::exception_ptr error, const std::string& worker,
                      std::string_view function, bool traced) {
  detail::OutFrame frame = detail::prepare(error_frame(id, std::move(error), worker, function));
  trace::detail::ScopedRecord slice(
      [&, bytes = frame.wire_bytes()] {
        return trace::detail::Record{.kind = trace::detail::Kind::reply_sent,
                                     .error = true,
                                     .peer = conn.peer_rank,
                                     .request = id,
                                     .bytes = bytes,
                                     .name = std::string(function)};
      },
      traced);
  conn.send(std::move(frame));
}

}  // namespace corpc
