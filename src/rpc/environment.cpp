// The environment's share of the options (see environment.hpp for the variables and the rule).
#include "rpc/environment.hpp"

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <string_view>

#include "corpc/rpc/errors.hpp"

#include "rpc/launch_protocol.hpp"

namespace corpc::detail {

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// The first of `names` that is set, as a number (leading digits, as atoi and stoi read them); UsageError naming the
// variable if it does not start with one. `chosen` (if given) gets the name read, or nullptr.
int env_int(std::initializer_list<const char*> names, int fallback, const char** chosen = nullptr) {
  if (chosen) *chosen = nullptr;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long value = std::strtol(v, &end, 10);
    if (end == v) throw UsageError(std::string(n) + "='" + v + "' is not a number");
    if (chosen) *chosen = n;
    return static_cast<int>(value);
  }
  return fallback;
}

// The launchers' rank and size variables, most specific first: a launcher started inside another's allocation sees
// the outer one's variables too (mpirun or MPICH's mpiexec in a Slurm batch script inherits the batch step's
// SLURM_PROCID=0 and SLURM_NTASKS), so Slurm's come last. RANK/WORLD_SIZE: torchrun, corpcrun, by hand.
constexpr std::initializer_list<const char*> kRankVariables = {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK",
                                                               "SLURM_PROCID"};
constexpr std::initializer_list<const char*> kSizeVariables = {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                               "SLURM_NTASKS"};

// Whether this process's rank is Slurm's (SLURM_PROCID, no other launcher's rank variable set).
bool rank_from_slurm() {
  const char* chosen = nullptr;
  env_int(kRankVariables, -1, &chosen);
  return chosen && std::string_view(chosen) == "SLURM_PROCID";
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
  if (!options.rejoin && rejoin_from_environment()) options.rejoin = true;
  if (options.init_timeout == defaults.init_timeout)
    options.init_timeout =
        std::chrono::milliseconds(env_int({"CORPC_INIT_TIMEOUT_MS"}, static_cast<int>(defaults.init_timeout.count())));
  if (options.replacement_wait == defaults.replacement_wait)
    options.replacement_wait = std::chrono::milliseconds(env_int({"CORPC_REPLACEMENT_WAIT_MS"}, 0));
  return options;
}

std::string secret_from_environment() { return env_or_empty("CORPC_SECRET"); }

int rank_from_environment() { return env_int(kRankVariables, -1); }

int world_size_from_environment() { return env_int(kSizeVariables, -1); }

std::string rank_variable() {
  const char* chosen = nullptr;
  env_int(kRankVariables, -1, &chosen);
  return chosen ? chosen : "RANK";
}

std::string world_size_variable() {
  const char* chosen = nullptr;
  env_int(kSizeVariables, -1, &chosen);
  return chosen ? chosen : "WORLD_SIZE";
}

std::string first_slurm_host(std::string_view list) {
  // The first item at bracket depth 0 ("node[1-2],login1" -> "node[1-2]"), then each bracket group replaced by its
  // first element as written ("n[01-04,7]" -> "n01"; "r[1-2]n[3-4]-ib" -> "r1n3-ib").
  std::string first;
  int depth = 0;
  for (char c : list) {
    if (c == ',' && depth == 0) break;
    if (c == '[') ++depth;
    if (c == ']') --depth;
    first += c;
  }
  std::string host;
  for (std::size_t i = 0; i < first.size(); ++i) {
    if (first[i] != '[') {
      host += first[i];
      continue;
    }
    const std::size_t close = first.find(']', i);
    if (close == std::string::npos) throw UsageError("Slurm node list '" + std::string(list) + "': no closing ']'");
    const std::string group = first.substr(i + 1, close - i - 1);
    host += group.substr(0, group.find_first_of(",-"));
    i = close;
  }
  return host;
}

std::string master_address_from_environment() {
  if (auto addr = env_or_empty("MASTER_ADDR"); !addr.empty()) return addr;
  // Under Slurm, task 0 runs on the first node of the step (srun's default block distribution): the step's node list,
  // or the job's in a batch script.
  if (rank_from_slurm()) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"})
      if (auto list = env_or_empty(name); !list.empty()) return first_slurm_host(list);
  }
  return {};
}

std::string master_source_from_environment() {
  std::string address = "MASTER_ADDR", port = "MASTER_PORT";
  if (env_or_empty("MASTER_ADDR").empty() && rank_from_slurm()) {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (env_or_empty(name).empty()) continue;
      address = std::string("the first host of ") + name;
      break;
    }
  }
  if (env_int({"MASTER_PORT"}, -1) < 0 && rank_from_slurm())
    port = env_int({"SLURM_STEP_RESV_PORTS"}, -1) > 0 ? "SLURM_STEP_RESV_PORTS" : "a port derived from SLURM_JOB_ID";
  return address + ", " + port;
}

int master_port_from_environment() {
  if (int port = env_int({"MASTER_PORT"}, -1); port >= 0) return port;
  if (!rank_from_slurm()) return -1;
  // Ports Slurm reserved for the step (MpiParams=ports=...): "12000-12003" or "12000,12005": the first.
  if (int port = env_int({"SLURM_STEP_RESV_PORTS"}, -1); port > 0) return port;
  // Else one every task of the step derives alike from the job and step ids, in 20000-29999 (below the ephemeral
  // range): two steps of one job running at once get different ones, two jobs may meet one in 1000 (set MASTER_PORT).
  const int job = env_int({"SLURM_JOB_ID", "SLURM_JOBID"}, -1);
  if (job < 0) return -1;
  const int step = std::max(0, env_int({"SLURM_STEP_ID", "SLURM_STEPID"}, 0));
  return 20000 + static_cast<int>((static_cast<long long>(job) * 10 + step % 10) % 10000);
}

int listen_fd_from_environment() { return env_int({"CORPC_LISTEN_FD"}, -1); }

bool agent_store_from_environment() { return env_or_empty("TORCHELASTIC_USE_AGENT_STORE") == "True"; }

bool launched_by_launch_processes() { return !env_or_empty(kLaunched).empty(); }

bool rejoin_from_environment() { return env_or_empty(kRejoin) == "1"; }

int rank_restart_from_environment() { return std::max(0, env_int({kRankRestart}, 0)); }

bool rank_leak_check_from_environment() { return !switched_off("CORPC_RANK_LEAK_CHECK"); }

bool started_by_corpc_launcher() { return launched_by_launch_processes() || !env_or_empty(kRankCredential).empty(); }

RankProofs rank_proofs_from_environment() {
  RankProofs p;
  p.launcher_key = env_or_empty(kRankKey);
  p.credential = env_or_empty(kRankCredential);
  p.incarnation = static_cast<std::uint32_t>(rank_restart_from_environment());
  return p;
}

}  // namespace corpc::detail
