// Listening on an abstract Unix socket: how this host's peers reach a worker without TCP (the RPC connections' Unix
// listener, the same-host channel's set-up listener).
#pragma once

#include <asio/local/stream_protocol.hpp>

#include <string>
#include <string_view>

namespace corpc::detail {

// Opens, binds and listens on "\0<prefix>-<pid>-<16 random characters>" and returns that name without its leading NUL
// (prepend one for sockaddr_un or an Asio endpoint). Abstract: nothing on the file system to clean up after a crash,
// reachable only in this network namespace. The random part keeps a stranger from squatting on the name in advance;
// whoever connects must still pass the acceptor's handshake. Throws std::system_error.
std::string listen_abstract(asio::local::stream_protocol::acceptor& acceptor, std::string_view prefix);

}  // namespace corpc::detail
