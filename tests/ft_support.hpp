// What the fault-tolerance tests (test_fault_tolerant.cpp, test_pipeline_replicas.cpp) share: the files their ranks
// write for the test process to read after the launch, and a model's state to compare bit for bit.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace corpc::test {

inline std::string file_in(const std::string& dir, const std::string& what, int rank) {
  return dir + "/" + what + std::to_string(rank);
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Whether a rank's log (lines that start with the step) has `word` on the line of `step`.
inline bool logged(const std::string& log, std::int64_t step, const std::string& word) {
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(std::to_string(step) + " ", 0) == 0 && line.find(word) != std::string::npos) return true;
  return false;
}

// Whether `error`, a survivor's reason for an attempt at `step` that was not committed, says so as every such error
// must: the step, then the cause, naming the worker it concerns by name and RPC rank.
inline bool names_step_cause_and_worker(const std::string& error, std::int64_t step) {
  static const std::regex form(
      "step ([0-9]+) was not committed: worker '[^']+' \\(rank [0-9]+\\)(, worker '[^']+' \\(rank [0-9]+\\))* "
      "(was lost|failed it|did not vote)");
  std::smatch m;
  return std::regex_search(error, m, form) && m[1] == std::to_string(step);
}

// The reasons a rank logged for its retried attempts ("STEP: REASON" lines): those of `step`.
inline std::vector<std::string> retry_reasons(const std::string& log, std::int64_t step) {
  std::vector<std::string> out;
  std::istringstream in(log);
  const std::string head = std::to_string(step) + ": ";
  for (std::string line; std::getline(in, line);)
    if (line.rfind(head, 0) == 0) out.push_back(line.substr(head.size()));
  return out;
}

// What is wrong with the reason a survivor's log gives for retrying `step`, or "" if nothing: there must be exactly one,
// naming the step, the cause and a worker (names_step_cause_and_worker), and when the cause is a loss, the worker
// lost must be `lost` ("worker 'worker2' (rank 2)"). A survivor whose own collective the loss cut may have reached
// the coordinator first: its reason then names itself ("failed it").
inline std::string survivor_reason_problem(const std::string& log, std::int64_t step, const std::string& lost) {
  const auto reasons = retry_reasons(log, step);
  if (reasons.size() != 1) return std::to_string(reasons.size()) + " reasons for step " + std::to_string(step);
  const std::string& reason = reasons[0];
  if (!names_step_cause_and_worker(reason, step)) return "not in the form every reason has: " + reason;
  if (reason.find(" was lost: ") != std::string::npos &&
      reason.find("step " + std::to_string(step) + " was not committed: " + lost + " was lost: ") != 0)
    return "a loss, not of " + lost + ": " + reason;
  return {};
}

// The optimizer's state of `p`: keyed by its TensorImpl's address, written out (libtorch 1.13) or as is (2.x).
template <class Map>
auto find_state(Map& state, const at::Tensor& p) {
  if constexpr (std::is_same_v<typename Map::key_type, std::string>) {
    std::ostringstream key;
    key << static_cast<void*>(p.unsafeGetTensorImpl());
    return state.find(key.str());
  } else {
    return state.find(p.unsafeGetTensorImpl());
  }
}

// Copies of `params`, then of each one's SGD momentum buffer (undefined before the first step).
inline std::vector<at::Tensor> sgd_state_of(const std::vector<at::Tensor>& params, torch::optim::Optimizer& opt) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  for (const auto& p : params) {
    auto it = find_state(opt.state(), p);
    out.push_back(it == opt.state().end()
                      ? at::Tensor()
                      : static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone());
  }
  return out;
}

}  // namespace corpc::test
