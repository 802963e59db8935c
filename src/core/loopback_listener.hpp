// A listening TCP socket on 127.0.0.1 with a port the OS chose: what a launcher holds open for rank 0, so that
// concurrent runs on one host never collide on a port. Shared by launch_processes and corpcrun, which links nothing
// of corpc: POSIX only, header-only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

namespace corpc::detail {

// Returns the descriptor and sets `port`, or returns -1 with errno set. `keep_across_exec`: the descriptor survives
// exec (a launcher that starts rank 0 as a new program); otherwise it is close-on-exec (rank 0 is forked).
inline int listen_on_loopback(int& port, bool keep_across_exec) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | (keep_across_exec ? 0 : SOCK_CLOEXEC), 0);
  if (fd < 0) return -1;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  // The longest backlog: every rank dials rank 0 at once, before rank 0 may even have started (a full queue drops
  // a connection, which retries only after a second).
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  port = ntohs(addr.sin_port);
  return fd;
}

}  // namespace corpc::detail
