// What a connection and a small message cost the kernel over TCP loopback against an abstract Unix socket, between two
// processes on one host: the question behind RpcOptions::same_host_socket. A standalone experiment, no corpc, no torch:
// the parent forks a server per case and talks to it with blocking sockets (TCP_NODELAY on TCP).
//   set-up     per iteration: connect and accept, then the shape of corpc's handshake (20 bytes out, 52 back, 72 out,
//              64 back), then close: what a new connection costs before its first reply;
//   ping-pong  32 bytes each way on one connection.
// Reported per iteration: wall time, and the CPU time of both processes (getrusage of self and of the waited-for
// child). Rounds alternate TCP and Unix.
//
//   build/bench/unix_socket_cost [rounds] [set-ups per round] [ping-pongs per round]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

void read_all(int fd, void* p, std::size_t n) {
  for (std::size_t got = 0; got < n;) {
    const ssize_t r = ::read(fd, static_cast<char*>(p) + got, n - got);
    if (r <= 0) {
      std::perror("read");
      std::_Exit(1);
    }
    got += static_cast<std::size_t>(r);
  }
}

void write_all(int fd, const void* p, std::size_t n) {
  if (::write(fd, p, n) != static_cast<ssize_t>(n)) {
    std::perror("write");
    std::_Exit(1);
  }
}

struct Listener {
  int fd = -1;
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = 0;
};

Listener listen_on(bool unix_socket) {
  Listener l;
  if (unix_socket) {
    l.fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un u{};
    u.sun_family = AF_UNIX;
    const std::string name = "corpc-unix-socket-cost-" + std::to_string(::getpid());
    std::memcpy(u.sun_path + 1, name.data(), name.size());  // abstract, as corpc's
    l.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    std::memcpy(&l.addr, &u, sizeof u);
    l.family = AF_UNIX;
    if (::bind(l.fd, reinterpret_cast<sockaddr*>(&u), l.len) != 0) std::perror("bind");
  } else {
    l.fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in in{};
    in.sin_family = AF_INET;
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t n = sizeof in;
    if (::bind(l.fd, reinterpret_cast<sockaddr*>(&in), sizeof in) != 0) std::perror("bind");
    ::getsockname(l.fd, reinterpret_cast<sockaddr*>(&in), &n);
    std::memcpy(&l.addr, &in, sizeof in);
    l.len = sizeof in;
    l.family = AF_INET;
  }
  ::listen(l.fd, 1024);
  return l;
}

void no_delay(int fd, bool unix_socket) {
  const int one = 1;
  if (!unix_socket) ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

double cpu_seconds(int who) {
  rusage r{};
  ::getrusage(who, &r);
  return static_cast<double>(r.ru_utime.tv_sec + r.ru_stime.tv_sec) +
         static_cast<double>(r.ru_utime.tv_usec + r.ru_stime.tv_usec) / 1e6;
}

// One case in a fresh pair of processes; prints µs per iteration, wall and CPU (both processes).
void run(bool unix_socket, bool set_up, int iterations) {
  const Listener l = listen_on(unix_socket);
  const double cpu_before = cpu_seconds(RUSAGE_SELF) + cpu_seconds(RUSAGE_CHILDREN);
  const auto start = std::chrono::steady_clock::now();
  char buf[256] = {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (set_up) {
      for (int i = 0; i < iterations; ++i) {
        const int c = ::accept(l.fd, nullptr, nullptr);
        no_delay(c, unix_socket);
        read_all(c, buf, 20);
        write_all(c, buf, 52);
        read_all(c, buf, 72);
        write_all(c, buf, 64);
        (void)::read(c, buf, 1);  // the client's close
        ::close(c);
      }
    } else {
      const int c = ::accept(l.fd, nullptr, nullptr);
      no_delay(c, unix_socket);
      for (int i = 0; i < iterations; ++i) {
        read_all(c, buf, 32);
        write_all(c, buf, 32);
      }
    }
    std::_Exit(0);
  }
  auto dial = [&] {
    const int c = ::socket(l.family, SOCK_STREAM, 0);
    if (::connect(c, reinterpret_cast<const sockaddr*>(&l.addr), l.len) != 0) {
      std::perror("connect");
      std::exit(1);
    }
    no_delay(c, unix_socket);
    return c;
  };
  if (set_up) {
    for (int i = 0; i < iterations; ++i) {
      const int c = dial();
      write_all(c, buf, 20);
      read_all(c, buf, 52);
      write_all(c, buf, 72);
      read_all(c, buf, 64);
      ::close(c);
    }
  } else {
    const int c = dial();
    for (int i = 0; i < iterations; ++i) {
      write_all(c, buf, 32);
      read_all(c, buf, 32);
    }
    ::close(c);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double cpu = cpu_seconds(RUSAGE_SELF) + cpu_seconds(RUSAGE_CHILDREN) - cpu_before;
  ::close(l.fd);
  std::printf("%-5s %-9s %9.1f %9.1f\n", unix_socket ? "unix" : "tcp", set_up ? "set-up" : "ping-pong",
              wall / iterations * 1e6, cpu / iterations * 1e6);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 3;
  const int set_ups = argc > 2 ? std::atoi(argv[2]) : 10000;
  const int ping_pongs = argc > 3 ? std::atoi(argv[3]) : 50000;
  if (rounds <= 0 || set_ups <= 0 || ping_pongs <= 0) {
    std::fprintf(stderr, "usage: unix_socket_cost [rounds] [set-ups per round] [ping-pongs per round]\n");
    return 2;
  }
  std::printf("%-5s %-9s %9s %9s\n", "", "case", "wall µs", "CPU µs");
  for (int r = 0; r < rounds; ++r) {
    for (const bool unix_socket : {false, true}) {
      run(unix_socket, true, set_ups);
      run(unix_socket, false, ping_pongs);
    }
  }
}
