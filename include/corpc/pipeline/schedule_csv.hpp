/// @file
/// Schedules as data in torch.distributed.pipelining's CSV format, so that an order made for PyTorch (its
/// `_PipelineScheduleRuntime._dump_csv`, or a solver's output) runs on corpc, and corpc's orders run there.
///
/// ```
///   0F0,0F1,3F0,3I0,3F1,3I1,0I0,3W0,...      row r: worker r's actions, in order
///   1F0,2F0,1F1,2F1,2I0,1I0,2I1,1I1,...
/// ```
/// A cell is `<stage><F|B|I|W><micro-batch>` (B: the whole backward; I and W: its input and weight halves), or an
/// overlapped forward and backward `(0F1;3B0)OVERLAP_F_B`. Empty cells (idle slots in PyTorch's grids) are skipped,
/// and so are the communication actions of its "with comms" format (SEND_F, RECV_F, SEND_B, RECV_B): here each
/// forward and backward receives and sends its own tensors. FSDP's UNSHARD, RESHARD and REDUCE_GRAD are a
/// UsageError. Check a loaded schedule with check_schedule, or give it to PipelineOptions::custom_actions, which does.
#pragma once

#include <cctype>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "corpc/pipeline/schedule.hpp"

namespace corpc::pipeline {

namespace detail {
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}
// Parses "<digits><type><digits?>" into (stage, type, micro); false if it is not that shape.
inline bool split_action(std::string_view cell, int& stage, std::string& type, int& micro) {
  std::size_t i = 0;
  while (i < cell.size() && std::isdigit(static_cast<unsigned char>(cell[i]))) ++i;
  std::size_t j = cell.size();
  while (j > i && std::isdigit(static_cast<unsigned char>(cell[j - 1]))) --j;
  if (i == 0 || j == i || i > 9 || cell.size() - j > 9) return false;
  stage = std::stoi(std::string(cell.substr(0, i)));
  type = std::string(cell.substr(i, j - i));
  micro = j == cell.size() ? -1 : std::stoi(std::string(cell.substr(j)));
  return true;
}
// Appends the actions of one cell to `out` (none for an empty cell or a communication action).
inline void parse_cell(std::string_view cell, std::vector<Action>& out, int row) {
  cell = trim(cell);
  if (cell.empty()) return;
  auto bad = [&](const std::string& why) {
    return UsageError("schedule CSV row " + std::to_string(row) + ", '" + std::string(cell) + "': " + why);
  };
  if (cell.front() == '(') {
    const auto close = cell.find(')');
    if (close == std::string_view::npos || trim(cell.substr(close + 1)) != "OVERLAP_F_B")
      throw bad("expected (F;B)OVERLAP_F_B");
    std::vector<Action> inner;
    std::string_view body = cell.substr(1, close - 1);
    for (std::size_t at = 0; at <= body.size();) {
      const auto semi = std::min(body.find(';', at), body.size());
      parse_cell(body.substr(at, semi - at), inner, row);
      at = semi + 1;
    }
    if (inner.size() != 2 || inner[0].kind != ActionKind::Forward || inner[1].kind == ActionKind::Forward)
      throw bad("an overlapped pair is a forward and a backward");
    inner[0].overlap = true;
    out.insert(out.end(), inner.begin(), inner.end());
    return;
  }
  int stage = 0, micro = 0;
  std::string type;
  if (!split_action(cell, stage, type, micro)) throw bad("expected <stage><F|B|I|W><micro-batch>, e.g. 2F0");
  if (type == "SEND_F" || type == "RECV_F" || type == "SEND_B" || type == "RECV_B") return;
  ActionKind kind;
  if (type == "F") kind = ActionKind::Forward;
  else if (type == "B") kind = ActionKind::Backward;
  else if (type == "I") kind = ActionKind::BackwardInput;
  else if (type == "W") kind = ActionKind::BackwardWeight;
  else throw bad("action type '" + type + "' is not run by corpc (F, B, I, W, OVERLAP_F_B; comms are skipped)");
  if (micro < 0) throw bad("no micro-batch index");
  out.push_back(Action{kind, stage, micro});
}
}  // namespace detail

/// Parses PyTorch's CSV action lists (one row per worker). UsageError naming the row and cell for anything else.
inline std::vector<std::vector<Action>> parse_schedule_csv(std::string_view text) {
  std::vector<std::vector<Action>> plan;
  int row = 0;
  for (std::size_t at = 0; at < text.size(); ++row) {
    auto end = text.find('\n', at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(at, end - at);
    at = end + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::vector<Action> actions;
    // A comma inside an overlapped pair's parentheses does not end the cell.
    int depth = 0;
    std::size_t cell_start = 0;
    for (std::size_t i = 0; i <= line.size(); ++i) {
      if (i < line.size() && line[i] == '(') ++depth;
      if (i < line.size() && line[i] == ')') --depth;
      if (i == line.size() || (line[i] == ',' && depth == 0)) {
        std::string_view cell = line.substr(cell_start, i - cell_start);
        if (cell.size() >= 2 && cell.front() == '"' && cell.back() == '"') cell = cell.substr(1, cell.size() - 2);
        detail::parse_cell(cell, actions, row);
        cell_start = i + 1;
      }
    }
    plan.push_back(std::move(actions));
  }
  while (!plan.empty() && plan.back().empty()) plan.pop_back();  // a trailing newline
  return plan;
}

/// Reads a schedule CSV file; UsageError if it cannot be read or parsed.
inline std::vector<std::vector<Action>> read_schedule_csv(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw UsageError("cannot read schedule file '" + path + "'");
  std::stringstream text;
  text << in.rdbuf();
  return parse_schedule_csv(text.str());
}

/// The CSV text of `plan`, one row per worker, as PyTorch's _load_csv reads it.
inline std::string schedule_to_csv(const std::vector<std::vector<Action>>& plan) {
  std::string out;
  auto cell = [](const Action& a) { return std::to_string(a.stage) + action_letter(a.kind) + std::to_string(a.micro); };
  for (auto& list : plan) {
    for (std::size_t i = 0; i < list.size(); ++i) {
      if (i) out += ',';
      if (list[i].overlap && i + 1 < list.size()) {
        out += '(';
        out += cell(list[i]);
        out += ';';
        out += cell(list[i + 1]);
        out += ")OVERLAP_F_B";
        ++i;
      } else {
        out += cell(list[i]);
      }
    }
    out += '\n';
  }
  return out;
}

/// Writes schedule_to_csv(plan) to `path`; UsageError if it cannot.
inline void write_schedule_csv(const std::string& path, const std::vector<std::vector<Action>>& plan) {
  std::ofstream out(path);
  out << schedule_to_csv(plan);
  if (!out) throw UsageError("cannot write schedule file '" + path + "'");
}

}  // namespace corpc::pipeline
