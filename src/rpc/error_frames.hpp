// Error frames: how an exception crosses the wire as a request's answer, [u8 code][worker][function][type][message],
// and is rebuilt as the same typed exception at the caller (error_frames.cpp).
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <string_view>

#include "corpc/wire/detail/message.hpp"

#include "transport/connection.hpp"

namespace corpc {

detail::Message error_frame(std::uint64_t id, std::exception_ptr error, const std::string& worker,
                            std::string_view function);
// Sends `error` on `conn` as the answer to request `id` (0: the connection itself is refused), from worker `worker`.
// `traced`: a user request's (the trace leaves shutdown's control rounds out).
void send_error_frame(detail::Connection& conn, std::uint64_t id, std::exception_ptr error, const std::string& worker,
                      std::string_view function, bool traced);
std::exception_ptr decode_error(const detail::Message& msg, const std::string& worker, std::string_view function);

}  // namespace corpc
