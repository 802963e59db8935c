#include "transport/abstract_socket.hpp"

#include <unistd.h>

#include "transport/auth.hpp"

namespace corpc::detail {

std::string listen_abstract(asio::local::stream_protocol::acceptor& acceptor, std::string_view prefix) {
  std::string name = std::string(prefix) + "-" + std::to_string(::getpid()) + "-" + random_secret().substr(0, 16);
  const asio::local::stream_protocol::endpoint at(std::string(1, '\0') + name);
  acceptor.open(at.protocol());
  acceptor.bind(at);
  acceptor.listen();
  return name;
}

}  // namespace corpc::detail
