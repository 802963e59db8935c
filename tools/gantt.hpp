// Gantt charts through gnuplot (Debian's `gnuplot`): rows of coloured boxes, optionally joined by arrows. Used by the
// pipeline benchmark's timeline (bench/pipeline_bench.cpp) and by `corpc-trace plot` (tools/corpc_trace.cpp).
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

namespace gantt {

struct Box {
  double start = 0, end = 0;  // x axis units (the chart's xlabel says which)
  int row = 0;
  int colour = 0;  // index into Chart::palette
};

struct Arrow {
  double x0 = 0;
  int row0 = 0;
  double x1 = 0;
  int row1 = 0;
};

struct Chart {
  std::string title, xlabel;
  std::vector<std::string> palette;               // colours ('#3b75af'), by Box::colour
  std::vector<std::pair<std::string, int>> rows;  // (label, row); rows run top to bottom
  int row_count = 0;                              // rows, gaps included
  double min_width = 0;                           // boxes narrower than this are widened to it, so they show
  std::vector<Box> boxes;
  std::vector<Arrow> arrows;
  int width_px = 1400;
};

// Writes `png` (with its data and script next to it: png.dat, png.gp). False if gnuplot failed or is missing.
inline bool draw(const std::string& png, const Chart& c) {
  const std::string data = png + ".dat", arrows = png + ".arrows.dat", script = png + ".gp";
  {
    std::ofstream d(data), a(arrows);
    for (const Box& b : c.boxes) {
      const double half = std::max(b.end - b.start, c.min_width) / 2;
      d << (b.start + b.end) / 2 << ' ' << b.row << ' ' << half << ' ' << 0.4 << ' ' << b.colour << '\n';
    }
    for (const Arrow& r : c.arrows) a << r.x0 << ' ' << r.row0 << ' ' << r.x1 - r.x0 << ' ' << r.row1 - r.row0 << '\n';
  }
  std::string ytics, palette;
  for (auto& [label, row] : c.rows) {
    if (!ytics.empty()) ytics += ", ";
    ytics += '"';
    ytics += label;
    ytics += "\" ";
    ytics += std::to_string(row);
  }
  for (std::size_t i = 0; i < c.palette.size(); ++i) {
    if (i) palette += ", ";
    palette += std::to_string(i);
    palette += " '";
    palette += c.palette[i];
    palette += '\'';
  }
  {
    std::ofstream g(script);
    g << "set terminal pngcairo size " << c.width_px << "," << 120 + 28 * c.row_count << " font 'sans,10'\n"
      << "set output '" << png << "'\nset xlabel '" << c.xlabel << "'\nset yrange [" << c.row_count << ":-1]\n"
      << "set ytics (" << ytics << ")\nset palette defined (" << palette
      << ")\nset cbrange [0:" << (c.palette.empty() ? 1 : c.palette.size() - 1) << "]\nunset colorbox\nset title '"
      << c.title << "'\nset grid xtics\n"
      << "plot '" << data << "' using 1:2:3:4:5 with boxxyerror fs solid 0.9 noborder lc palette notitle";
    if (!c.arrows.empty())
      g << ", '" << arrows
        << "' using 1:2:3:4 with vectors head filled size screen 0.006,20 lw 0.8 lc rgb '#555555' notitle";
    g << '\n';
  }
  const std::string cmd = "gnuplot '" + script + "'";
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "# gnuplot failed or is missing: no %s\n", png.c_str());
    return false;
  }
  std::fprintf(stderr, "# wrote %s\n", png.c_str());
  return true;
}

}  // namespace gantt
