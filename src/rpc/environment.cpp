// The environment's share of the options (see environment.hpp for the variables and the rule).
#include "rpc/environment.hpp"

#include <algorithm>

#include <cstdlib>
#include <initializer_list>

#include "corpc/rpc/errors.hpp"

namespace corpc::detail {

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// The first of `names` that is set, as a number (leading digits, as atoi and stoi read them); UsageError naming the
// variable if it does not start with one.
int env_int(std::initializer_list<const char*> names, int fallback) {
  for (const char* n : names) {
    const char* v = std::getenv(n);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long value = std::strtol(v, &end, 10);
    if (end == v) throw UsageError(std::string(n) + "='" + v + "' is not a number");
    return static_cast<int>(value);
  }
  return fallback;
}

bool switched_off(const char* name) { return env_or_empty(name) == "0"; }

}  // namespace

RpcOptions with_environment(RpcOptions options) {
  const RpcOptions defaults;
  if (options.secret.empty()) options.secret = secret_from_environment();
  if (!options.tls) {
    if (auto cert = env_or_empty("CORPC_TLS_CERT"); !cert.empty()) {
      TlsOptions tls;
      tls.certificate_chain_file = std::move(cert);
      tls.private_key_file = env_or_empty("CORPC_TLS_KEY");
      tls.ca_file = env_or_empty("CORPC_TLS_CA");
      tls.verify_peer = !switched_off("CORPC_TLS_VERIFY");
      options.tls = std::move(tls);
    }
  }
  if (options.seal_frames == defaults.seal_frames && switched_off("CORPC_SEAL_FRAMES")) options.seal_frames = false;
  if (options.trace_path.empty()) options.trace_path = env_or_empty("CORPC_TRACE");
  if (options.same_host_socket == defaults.same_host_socket && switched_off("CORPC_SAME_HOST_SOCKET"))
    options.same_host_socket = false;
  if (options.same_host_channel == defaults.same_host_channel && switched_off("CORPC_SAME_HOST_CHANNEL"))
    options.same_host_channel = false;
  if (options.cuda_ipc == defaults.cuda_ipc && switched_off("CORPC_CUDA_IPC")) options.cuda_ipc = false;
  if (!options.rejoin && env_or_empty("CORPC_REJOIN") == "1") options.rejoin = true;
  if (options.replacement_wait == defaults.replacement_wait)
    options.replacement_wait = std::chrono::milliseconds(env_int({"CORPC_REPLACEMENT_WAIT_MS"}, 0));
  return options;
}

std::string secret_from_environment() { return env_or_empty("CORPC_SECRET"); }

int rank_from_environment() { return env_int({"RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}, -1); }

int world_size_from_environment() {
  return env_int({"WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, -1);
}

std::string master_address_from_environment() { return env_or_empty("MASTER_ADDR"); }

int master_port_from_environment() { return env_int({"MASTER_PORT"}, -1); }

int listen_fd_from_environment() { return env_int({"CORPC_LISTEN_FD"}, -1); }

bool agent_store_from_environment() { return env_or_empty("TORCHELASTIC_USE_AGENT_STORE") == "True"; }

RankProofs rank_proofs_from_environment() {
  RankProofs p;
  p.launcher_key = env_or_empty("CORPC_RANK_KEY");
  p.credential = env_or_empty("CORPC_RANK_CREDENTIAL");
  p.incarnation = static_cast<std::uint32_t>(std::max(0, env_int({"CORPC_RANK_RESTART"}, 0)));
  return p;
}

}  // namespace corpc::detail
