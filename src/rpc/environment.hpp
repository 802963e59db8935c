// Every environment variable the RPC runtime reads, in one place and under one rule: a variable fills an option the
// program left at its default, and an option the program set wins. The variables, by option:
//   secret             CORPC_SECRET
//   tls                CORPC_TLS_CERT (TLS on when set), CORPC_TLS_KEY, CORPC_TLS_CA, CORPC_TLS_VERIFY=0
//   trace_path         CORPC_TRACE
//   seal_frames        CORPC_SEAL_FRAMES=0 (off)
//   same_host_socket   CORPC_SAME_HOST_SOCKET=0 (off)
//   same_host_channel  CORPC_SAME_HOST_CHANNEL=0 (off)
//   cuda_ipc           CORPC_CUDA_IPC=0 (off)
//   rejoin             CORPC_REJOIN=1 (on: a launcher restarted this rank in place)
//   init_timeout       CORPC_INIT_TIMEOUT_MS
//   replacement_wait   CORPC_REPLACEMENT_WAIT_MS
// and what init_rpc is not given: the rank and world size (RANK/WORLD_SIZE, or Open MPI's, PMI's, Slurm's), rank 0's
// address for env:// (MASTER_ADDR, MASTER_PORT; under Slurm, derived from its node list and job id when unset), a
// socket a launcher bound for rank 0 (CORPC_LISTEN_FD), and what a launcher deals to prove ranks (CORPC_RANK_KEY to
// rank 0, CORPC_RANK_CREDENTIAL to the others, CORPC_RANK_RESTART), whether launch_processes started this process
// (CORPC_LAUNCHED), and in sanitized builds CORPC_RANK_LEAK_CHECK.
// init_process_group (ddp/process_group.cpp) reads the launcher's variables here too, and torchrun's agent store.
// Outside this file, readers remain only for protocols of their own: CORPC_LOG (core/log.cpp: logging exists before
// any runtime) and the variables between launch_processes and its ranks (rpc/launch_protocol.cpp). The layer check
// (tools/check_layers.py) fails the build on a getenv anywhere else in src/ or include/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "corpc/rpc/options.hpp"

namespace corpc::detail {

RpcOptions with_environment(RpcOptions options);

std::string secret_from_environment();  // CORPC_SECRET, or empty
int rank_from_environment();            // -1 if no launcher said; UsageError if not a number
int world_size_from_environment();      // -1 if no launcher said
std::string rank_variable();            // the variable the rank was read from (RANK if none), for messages
std::string world_size_variable();      // the same for the world size (WORLD_SIZE if none)
// MASTER_ADDR; under Slurm without it, the first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST); or empty.
std::string master_address_from_environment();
// MASTER_PORT; under Slurm without it, the first of SLURM_STEP_RESV_PORTS, or a port derived from SLURM_JOB_ID and
// SLURM_STEP_ID (20000-29999, the same in every task of a step); or -1.
int master_port_from_environment();
// Where those two came from, for messages: "MASTER_ADDR, MASTER_PORT", or under Slurm e.g. "the first host of
// SLURM_STEP_NODELIST, a port derived from SLURM_JOB_ID".
std::string master_source_from_environment();
// The first host of a Slurm node list, as `scontrol show hostnames LIST | head -1` prints it ("node[1-2]" -> "node1").
std::string first_slurm_host(std::string_view list);
int listen_fd_from_environment();     // CORPC_LISTEN_FD, or -1
bool agent_store_from_environment();  // torchrun's agent serves a store on MASTER_PORT
// Whether this process is a rank that launch_processes or corpcrun started (CORPC_LAUNCHED, or the rank credential
// they deal every rank): there rank 0 holds MASTER_PORT's listening socket for RPC from the start.
bool started_by_corpc_launcher();
// Whether launch_processes started this process as one of its ranks (CORPC_LAUNCHED): its RANK is ours, not a
// launcher's.
bool launched_by_launch_processes();
bool rejoin_from_environment();       // CORPC_REJOIN=1: a launcher restarted this rank in place
int rank_restart_from_environment();  // CORPC_RANK_RESTART, or 0
// CORPC_RANK_LEAK_CHECK=0 turns off LeakSanitizer's check in a sanitized rank as it ends (tests that fork).
bool rank_leak_check_from_environment();

// What the launcher dealt this process to prove which rank it is (transport/rank_identity.hpp); empty strings under a
// launcher that deals none (torchrun, Slurm).
struct RankProofs {
  std::string launcher_key;       // CORPC_RANK_KEY: rank 0 only
  std::string credential;         // CORPC_RANK_CREDENTIAL: this rank's, for this incarnation
  std::uint32_t incarnation = 0;  // CORPC_RANK_RESTART: how many times the launcher restarted this rank
};
RankProofs rank_proofs_from_environment();

}  // namespace corpc::detail
