// libFuzzer target: the argument codec. The first byte picks one of the argument types below; the rest is decoded as
// that type. Property: decoding throws ProtocolError or yields a value whose encoding decodes to a value with the
// same encoding (a fixed point after one round: maps and sets drop duplicate keys on the first decode), and no
// decode allocates far beyond its input (libFuzzer's -rss_limit_mb / -malloc_limit_mb catch that).
#include <array>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "corpc/rpc/worker_info.hpp"
#include "corpc/wire/codec.hpp"

namespace {

struct Point {
  double x = 0;
  std::int32_t y = 0;
  std::vector<std::string> tags;
  std::optional<std::map<std::string, std::int64_t>> extra;
  CORPC_FIELDS(x, y, tags, extra)
};

template <class T>
void round_trip(const std::uint8_t* data, std::size_t size) {
  T v;
  try {
    corpc::Reader r(data, size);
    v = r.get<T>();
  } catch (const corpc::ProtocolError&) {
    return;
  }
  std::string first;
  corpc::Writer(first).put(v);
  corpc::Reader r2(first.data(), first.size());
  T v2 = r2.get<T>();  // must not throw: we wrote it
  if (r2.remaining() != 0) std::abort();
  std::string second;
  corpc::Writer(second).put(v2);
  if (first != second) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t* p = data + 1;
  const std::size_t n = size - 1;
  switch (data[0] % 12) {
    case 0: round_trip<std::string>(p, n); break;
    case 1: round_trip<std::vector<std::int64_t>>(p, n); break;
    case 2: round_trip<std::vector<std::string>>(p, n); break;
    case 3: round_trip<std::map<std::string, std::vector<double>>>(p, n); break;
    case 4: round_trip<std::optional<std::tuple<int, bool, std::string>>>(p, n); break;
    case 5: round_trip<std::set<std::int32_t>>(p, n); break;
    case 6: round_trip<std::vector<std::monostate>>(p, n); break;
    case 7: round_trip<std::vector<std::vector<std::uint8_t>>>(p, n); break;
    case 8: round_trip<std::pair<std::array<std::int16_t, 3>, std::vector<bool>>>(p, n); break;
    case 9: round_trip<corpc::WorkerInfo>(p, n); break;
    case 10: round_trip<Point>(p, n); break;
    case 11: round_trip<std::vector<std::vector<std::monostate>>>(p, n); break;
  }
  return 0;
}
