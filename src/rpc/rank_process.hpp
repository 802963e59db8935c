// A rank's process, as launch_processes starts it: forked (it runs `fn` at once) or spawned (the program again, with
// the variables of src/rpc/launch_protocol.hpp), and how it ends: `fn`, the runtime it left open shut down, its
// report written, _exit. Private to the launcher.
#pragma once

#include <sys/types.h>

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace corpc::detail {

class RankSecrets;

// Runs one rank's function; a runtime it left running is shut down for it. Returns why the rank failed ("" if not).
std::string run_rank(int rank, const std::function<void(int)>& fn);

// The end of a rank's process, in both start methods: runs `fn`, reports on `report_fd` (kStarted, then the error
// text), leaves without the exit handlers and static destructors of state that belongs to the caller (fork) or to a
// main that never finished (spawn).
[[noreturn]] void run_rank_and_exit(int rank, int report_fd, const std::function<void(int)>& fn);

// The variables every rank gets, as torchrun sets them, plus corpc's own; `restart` counts the rank's restarts, and
// `secrets` is what the launcher dealt this start of the rank.
std::vector<std::pair<std::string, std::string>> rank_environment(int rank, int world_size, int port,
                                                                  const std::string& secret, int restart,
                                                                  const RankSecrets& secrets);

// In a forked child: takes on the rank's variables and runs it. `listen_fd` is rank 0's socket, or -1 once the
// launcher has closed it (a restart, never of rank 0).
[[noreturn]] void run_forked_child(int rank, int world_size, int port, int listen_fd, int report_fd,
                                   const std::string& secret, int restart, const RankSecrets& secrets,
                                   const std::function<void(int)>& fn);

// This program's path and arguments, as it was started: what a spawned rank runs.
struct Program {
  std::string path;
  std::vector<std::string> args;
};
Program this_program();

// Everything execve needs, made before fork: between fork and exec the child may only make async-signal-safe calls.
struct ExecImage {
  std::vector<std::string> strings;  // owns what the pointer arrays point into
  std::vector<char*> argv, envp;
};
// `vars` are set; the caller's values of the `hidden` names are not passed on.
ExecImage exec_image(const Program& program, const std::vector<std::pair<std::string, std::string>>& vars,
                     const std::set<std::string>& hidden);

// Forks and runs `image`; the child keeps `report_fd` and `inherited_fd` (if >= 0) across exec and dies with us.
pid_t spawn_child(const std::string& path, const ExecImage& image, int report_fd, int inherited_fd);

}  // namespace corpc::detail
