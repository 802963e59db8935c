// corpc-trace: merges trace parts by hand, and draws a job trace as a PNG (corpc/core/trace.hpp).
//
//   corpc-trace merge OUT.json PART.json...            e.g. the parts of a run whose rank 0 died
//   corpc-trace plot TRACE.json OUT.png [--from MS] [--to MS]
//
// `plot` draws a row per thread of each worker, a box per slice (blue: call leaving, green: run on the callee,
// orange: reply, purple: large transfer, red: backward pass, grey: the rest) and the flow arrows, with gnuplot.
// Torch-free: it builds in a second.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "corpc/core/trace.hpp"

#include "gantt.hpp"
#include "mini_json.hpp"

namespace {

int usage() {
  std::fputs(
      "usage: corpc-trace merge OUT.json PART.json...\n"
      "       corpc-trace plot TRACE.json OUT.png [--from MS] [--to MS]\n",
      stderr);
  return 2;
}

int colour_of(const std::string& cat) {
  static const std::map<std::string, int> colours{
      {"call", 0}, {"run", 1}, {"reply", 2}, {"tensors", 3}, {"autograd", 4}};
  auto it = colours.find(cat);
  return it == colours.end() ? 5 : it->second;
}

using Track = std::pair<int, int>;  // (pid, tid)

Track track_of(const mini_json::Value& e) {
  return {static_cast<int>(e["pid"].num()), static_cast<int>(e["tid"].num())};
}

// The names of processes and threads (metadata events), and the start of the time axis: the first slice.
struct TraceNames {
  std::map<int, std::string> processes;
  std::map<Track, std::string> threads;
  double origin = 1e300;  // µs
};

TraceNames names_of(const mini_json::Array& events) {
  TraceNames names;
  for (const auto& e : events) {
    const std::string ph = e["ph"].string_or("");
    const Track t{static_cast<int>(e["pid"].number_or(0)), static_cast<int>(e["tid"].number_or(0))};
    if (ph == "M" && e["name"].string_or("") == "process_name")
      names.processes[t.first] = e["args"]["name"].string_or("");
    if (ph == "M" && e["name"].string_or("") == "thread_name") names.threads[t] = e["args"]["name"].string_or("");
    if (ph == "X") names.origin = std::min(names.origin, e["ts"].num());
  }
  return names;
}

// The part of the trace drawn, in ms from the first slice.
struct Window {
  double origin_us, from_ms, to_ms;
  double ms(double us) const { return (us - origin_us) / 1000.0; }
  bool shows(double t) const { return t >= from_ms && t <= to_ms; }
};

// A row per track with slices in the window, workers apart by a gap; labels them in `chart`. Track -> row.
std::map<Track, int> lay_out_rows(const mini_json::Array& events, const TraceNames& names, const Window& window,
                                  gantt::Chart& chart) {
  std::map<Track, int> rows;
  for (const auto& e : events)
    if (e["ph"].string_or("") == "X" && window.shows(window.ms(e["ts"].num()))) rows[track_of(e)] = 0;
  int row = 0, last_pid = -1;
  for (auto& [track, r] : rows) {
    if (last_pid != -1 && track.first != last_pid) ++row;  // a gap between workers
    last_pid = track.first;
    r = row++;
    auto p = names.processes.find(track.first);
    auto t = names.threads.find(track);
    chart.rows.emplace_back((p == names.processes.end() ? "pid " + std::to_string(track.first) : p->second) + " / " +
                                (t == names.threads.end() ? "tid " + std::to_string(track.second) : t->second),
                            r);
  }
  chart.row_count = row;
  return rows;
}

// A box per slice in the window, and an arrow per flow with both ends in it.
void add_slices_and_flows(const mini_json::Array& events, const std::map<Track, int>& rows, const Window& window,
                          gantt::Chart& chart) {
  double lo = 1e300, hi = -1e300;
  std::map<std::string, std::pair<gantt::Arrow, int>> flows;  // name+id -> arrow, ends seen (1: start, 2: end)
  for (const auto& e : events) {
    const std::string ph = e["ph"].string_or("");
    if (ph != "X" && ph != "s" && ph != "f") continue;
    const double t = window.ms(e["ts"].num());
    if (!window.shows(t)) continue;
    auto it = rows.find(track_of(e));
    if (it == rows.end()) continue;
    if (ph == "X") {
      const double end = t + e["dur"].number_or(0) / 1000.0;
      chart.boxes.push_back({t, end, it->second, colour_of(e["cat"].string_or(""))});
      lo = std::min(lo, t), hi = std::max(hi, end);
      continue;
    }
    auto& [arrow, seen] = flows[e["name"].string_or("") + " " + e["id"].string_or("")];
    if (ph == "s") arrow.x0 = t, arrow.row0 = it->second, seen |= 1;
    else arrow.x1 = t, arrow.row1 = it->second, seen |= 2;
  }
  for (auto& [key, f] : flows)
    if (f.second == 3) chart.arrows.push_back(f.first);
  chart.min_width = hi > lo ? (hi - lo) * 0.002 : 0;
}

int plot(const std::string& in, const std::string& png, double from_ms, double to_ms) {
  std::ifstream f(in);
  if (!f) return std::fprintf(stderr, "corpc-trace: cannot read %s\n", in.c_str()), 1;
  std::stringstream ss;
  ss << f.rdbuf();
  const auto trace = mini_json::parse(ss.str());
  const auto& events = trace["traceEvents"].arr();

  const auto names = names_of(events);
  const Window window{names.origin, from_ms, to_ms};
  gantt::Chart chart;
  const auto rows = lay_out_rows(events, names, window, chart);
  add_slices_and_flows(events, rows, window, chart);
  chart.title =
      "corpc trace: call (blue), run (green), reply (orange), transfer (purple), backward (red); arrows: flows";
  chart.xlabel = "ms from the first slice";
  chart.palette = {"#3b75af", "#519e3e", "#ef8636", "#8c62aa", "#c03d3e", "#999999"};
  return gantt::draw(png, chart) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string cmd = argv[1];
  try {
    if (cmd == "merge" && argc >= 4) {
      std::vector<std::string> inputs(argv + 3, argv + argc);
      const auto n = corpc::trace::merge_chrome_traces(argv[2], inputs);
      std::fprintf(stderr, "corpc-trace: %zu events into %s\n", n, argv[2]);
      return 0;
    }
    if (cmd == "plot" && argc >= 4) {
      double from = -1e300, to = 1e300;
      for (int i = 4; i + 1 < argc; i += 2) {
        const std::string opt = argv[i];
        if (opt == "--from") from = std::atof(argv[i + 1]);
        else if (opt == "--to") to = std::atof(argv[i + 1]);
        else return usage();
      }
      return plot(argv[2], argv[3], from, to);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "corpc-trace: %s\n", e.what());
    return 1;
  }
  return usage();
}
