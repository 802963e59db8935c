// Small helpers shared by the benchmarks: machine facts printed at start, flag parsing, a clock, a median, futex.
#pragma once

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace corpc::bench {

// CLOCK_MONOTONIC in nanoseconds: one clock for every process on the host.
inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The middle value (the mean of the middle two for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// futex(2) on a word that may be shared between processes (so never FUTEX_PRIVATE_FLAG).
inline long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t value) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

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

// A command line that cannot be read: an unknown flag, a flag without its value, a value of the wrong form. what()
// says which, in words for the user.
struct FlagError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// --name value / --name=value flags over argv; a one-letter name is spelled -x. Two ways to read a command line:
//  - Flags(argc, argv) looks a name up when asked and ignores everything else (a benchmark with a handful of flags
//    needs no more).
//  - Flags(argc, argv, takes_value, switches) is told every flag the program takes, and reads argv in order, as a
//    shell user expects: a flag in takes_value consumes its `=value` or the next argument, whatever it is; a switch
//    takes none (an `=value` after it is ignored); a flag given twice keeps its last value. The first argument that
//    is no such flag, or a value missing at the end, is an error that check() throws, so that a program can still
//    answer --help first.
// The get_* conversions throw FlagError naming the flag whose value is not a number (of that type).
class Flags {
 public:
  Flags(int argc, char** argv) : args_(argv + 1, argv + argc) {}
  Flags(int argc, char** argv, const std::vector<std::string>& takes_value, const std::vector<std::string>& switches)
      : args_(argv + 1, argv + argc), declared_(true) {
    for (std::size_t i = 0; i < args_.size(); ++i) {
      const std::string& a = args_[i];
      const std::size_t eq = a.find('=');
      const std::string key = a.substr(0, eq);
      auto spelled_as_key = [&](const std::string& name) { return spelled(name) == key; };
      if (auto s = std::find_if(switches.begin(), switches.end(), spelled_as_key); s != switches.end()) {
        given_.emplace_back(*s, std::string());
      } else if (auto v = std::find_if(takes_value.begin(), takes_value.end(), spelled_as_key);
                 v != takes_value.end()) {
        if (eq != std::string::npos) {
          given_.emplace_back(*v, a.substr(eq + 1));
        } else if (i + 1 < args_.size()) {
          given_.emplace_back(*v, args_[++i]);
        } else {
          if (error_.empty()) error_ = "missing value for " + key;
          break;
        }
      } else if (error_.empty()) {
        error_ = "unknown option '" + a + "'";
      }
    }
  }

  // Throws FlagError for the first argument that is not one of the declared flags (declared flags only).
  void check() const {
    if (!error_.empty()) throw FlagError(error_);
  }

  bool has(const std::string& name) const {
    if (declared_) return last(name) != nullptr;
    for (auto& a : args_)
      if (a == spelled(name)) return true;
    return false;
  }
  std::string get(const std::string& name, const std::string& fallback) const { return value(name).value_or(fallback); }
  // An integer of type T (long unless asked for another): `flags.get_int<int>("iters", 20)`.
  template <class T = long>
  T get_int(const std::string& name, std::type_identity_t<T> fallback) const {
    const auto text = value(name);
    if (!text) return fallback;
    const long v = number(name, *text, [](const std::string& s) { return std::stol(s); });
    if (!std::in_range<T>(v)) throw FlagError("bad value for " + spelled(name));
    return static_cast<T>(v);
  }
  double get_double(const std::string& name, double fallback) const {
    const auto text = value(name);
    if (!text) return fallback;
    return number(name, *text, [](const std::string& s) { return std::stod(s); });
  }
  std::vector<long> get_list(const std::string& name, const std::string& fallback) const {
    std::vector<long> out;
    std::string s = get(name, fallback);
    for (std::size_t pos = 0; pos <= s.size();) {
      auto comma = s.find(',', pos);
      if (comma == std::string::npos) comma = s.size();
      if (comma > pos)
        out.push_back(number(name, s.substr(pos, comma - pos), [](const std::string& t) { return std::stol(t); }));
      pos = comma + 1;
    }
    return out;
  }

 private:
  static std::string spelled(const std::string& name) { return (name.size() == 1 ? "-" : "--") + name; }

  // The value of the last occurrence of a declared flag, or nullptr.
  const std::string* last(const std::string& name) const {
    for (auto it = given_.rbegin(); it != given_.rend(); ++it)
      if (it->first == name) return &it->second;
    return nullptr;
  }
  // The flag's value: the last one given (declared flags), or the first (otherwise); nullopt if it has none.
  std::optional<std::string> value(const std::string& name) const {
    if (declared_) {
      const std::string* v = last(name);
      return v ? std::optional<std::string>(*v) : std::nullopt;
    }
    for (std::size_t i = 0; i < args_.size(); ++i) {
      if (args_[i] == spelled(name) && i + 1 < args_.size()) return args_[i + 1];
      if (args_[i].rfind(spelled(name) + "=", 0) == 0) return args_[i].substr(spelled(name).size() + 1);
    }
    return std::nullopt;
  }
  // `text` read by `parse` (std::stol, std::stod: leading blanks skipped, trailing text ignored).
  template <class Parse>
  static auto number(const std::string& name, const std::string& text, Parse parse) -> decltype(parse(text)) {
    try {
      return parse(text);
    } catch (const std::logic_error&) {  // std::invalid_argument, std::out_of_range
      throw FlagError("bad value for " + spelled(name));
    }
  }

  std::vector<std::string> args_;
  bool declared_ = false;
  std::vector<std::pair<std::string, std::string>> given_;  // declared flags as read: (name, value), in order
  std::string error_;                                       // the first argument that is not a declared flag
};

}  // namespace corpc::bench
