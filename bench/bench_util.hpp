// Small helpers shared by the benchmarks: machine facts printed at start, flag parsing.
#pragma once

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace corpc::bench {

// Which BLAS libtorch will load (Debian's reference BLAS is ~15x slower than OpenBLAS for convolutions).
inline std::string blas_in_use() {
  char buf[4096];
  const char* link = "/usr/lib/x86_64-linux-gnu/libblas.so.3";
  if (char* p = ::realpath(link, buf)) return p;
  return "unknown (no " + std::string(link) + ")";
}

// OpenBLAS (Debian's libopenblas0-pthread) runs its own thread pool, sized to the machine and busy-waiting with
// sched_yield, beside OpenMP's: "N intra-op threads per process" must cap it too, or 3 processes on 2 cores spin.
// Returns false if the BLAS in use is not OpenBLAS.
inline bool set_blas_threads(int n) {
  using Fn = void (*)(int);
  if (auto fn = reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
    fn(n);
    return true;
  }
  return false;
}

// OpenBLAS's pool size, or -1 if the BLAS in use is not OpenBLAS.
inline int blas_threads() {
  using Fn = int (*)();
  if (auto fn = reinterpret_cast<Fn>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"))) return fn();
  return -1;
}

inline void print_machine() {
  std::printf("# cores: %u   BLAS: %s\n", std::thread::hardware_concurrency(), blas_in_use().c_str());
}

// --name value / --name=value flags over argv.
class Flags {
 public:
  Flags(int argc, char** argv) : args_(argv + 1, argv + argc) {}
  bool has(const std::string& name) const {
    for (auto& a : args_)
      if (a == "--" + name) return true;
    return false;
  }
  std::string get(const std::string& name, const std::string& fallback) const {
    for (std::size_t i = 0; i < args_.size(); ++i) {
      if (args_[i] == "--" + name && i + 1 < args_.size()) return args_[i + 1];
      if (args_[i].rfind("--" + name + "=", 0) == 0) return args_[i].substr(name.size() + 3);
    }
    return fallback;
  }
  long get_int(const std::string& name, long fallback) const { return std::stol(get(name, std::to_string(fallback))); }
  std::vector<long> get_list(const std::string& name, const std::string& fallback) const {
    std::vector<long> out;
    std::string s = get(name, fallback);
    for (std::size_t pos = 0; pos <= s.size();) {
      auto comma = s.find(',', pos);
      if (comma == std::string::npos) comma = s.size();
      if (comma > pos) out.push_back(std::stol(s.substr(pos, comma - pos)));
      pos = comma + 1;
    }
    return out;
  }

 private:
  std::vector<std::string> args_;
};

}  // namespace corpc::bench
