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

int plot(const std::string& in, const std::string& png, double from_ms, double to_ms) {
  std::ifstream f(in);
  if (!f) return std::fprintf(stderr, "corpc-trace: cannot read %s\n", in.c_str()), 1;
  std::stringstream ss;
  ss << f.rdbuf();
  const auto trace = mini_json::parse(ss.str());
  const auto& events = trace["traceEvents"].arr();

  using Track = std::pair<int, int>;  // (pid, tid)
  std::map<int, std::string> processes;
  std::map<Track, std::string> threads;
  double origin = 1e300;
  for (const auto& e : events) {
    const std::string ph = e["ph"].string_or("");
    const Track t{static_cast<int>(e["pid"].number_or(0)), static_cast<int>(e["tid"].number_or(0))};
    if (ph == "M" && e["name"].string_or("") == "process_name") processes[t.first] = e["args"]["name"].string_or("");
    if (ph == "M" && e["name"].string_or("") == "thread_name") threads[t] = e["args"]["name"].string_or("");
    if (ph == "X") origin = std::min(origin, e["ts"].num());
  }
  auto ms = [&](double us) { return (us - origin) / 1000.0; };
  auto shown = [&](double t) { return t >= from_ms && t <= to_ms; };

  std::map<Track, int> rows;  // tracks with slices in the window
  for (const auto& e : events)
    if (e["ph"].string_or("") == "X" && shown(ms(e["ts"].num())))
      rows[{static_cast<int>(e["pid"].num()), static_cast<int>(e["tid"].num())}] = 0;
  gantt::Chart chart;
  int row = 0, last_pid = -1;
  for (auto& [track, r] : rows) {
    if (last_pid != -1 && track.first != last_pid) ++row;  // a gap between workers
    last_pid = track.first;
    r = row++;
    auto p = processes.find(track.first);
    auto t = threads.find(track);
    chart.rows.emplace_back((p == processes.end() ? "pid " + std::to_string(track.first) : p->second) + " / " +
                                (t == threads.end() ? "tid " + std::to_string(track.second) : t->second),
                            r);
  }
  chart.row_count = row;
  double lo = 1e300, hi = -1e300;
  std::map<std::string, std::pair<gantt::Arrow, int>> flows;  // name+id -> arrow, ends seen (1: start, 2: end)
  for (const auto& e : events) {
    const std::string ph = e["ph"].string_or("");
    if (ph != "X" && ph != "s" && ph != "f") continue;
    const double t = ms(e["ts"].num());
    if (!shown(t)) continue;
    auto it = rows.find({static_cast<int>(e["pid"].num()), static_cast<int>(e["tid"].num())});
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
