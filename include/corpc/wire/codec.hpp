/// @file
/// The binary encoding of arguments and results (everything but tensor data).
///
/// Layout: little-endian fixed-width integers and floats; strings and containers as a u32 count then elements.
/// Tensors are not inlined: the writer puts them in a side table and encodes their index, and the transport sends
/// their bytes out of band, straight from storage (corpc/wire/tensor_codec.hpp).
///
/// Reading is defensive: every length is checked against the bytes that remain before anything is allocated, so a
/// malformed or hostile payload ends in ProtocolError, never in a huge allocation or an out-of-bounds read.
///
/// Supported out of the box: arithmetic types, enums, bool, std::string, std::vector, std::array, std::optional,
/// std::pair, std::tuple, std::variant, std::map, std::unordered_map, std::set, std::monostate, torch tensors
/// (tensor_codec.hpp), and c10::Scalar, c10::Device, at::ScalarType, c10::optional, c10::variant and torch's option
/// tags such as torch::kSum (torch_codec.hpp). Enums travel as their underlying value, unchecked: an enum whose
/// receiver must reject values outside its enumerators needs its own Codec (as at::ScalarType has).
/// Your own types, either way:
/// ```cpp
///   struct Point { double x, y; CORPC_FIELDS(x, y) };            // encodes each field in order
///   template <> struct corpc::Codec<Mine> { static void write(Writer&, const Mine&); static Mine read(Reader&); };
/// ```
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "corpc/wire/errors.hpp"

namespace at {
class Tensor;
}

namespace corpc {

static_assert(std::endian::native == std::endian::little, "corpc's wire format assumes a little-endian host");

/// How a `T` travels as an argument or result: specialise it for your type, or list the type's fields with
/// CORPC_FIELDS. A specialization has two static members:
/// ```cpp
///   static void write(corpc::Writer& w, const T& v);  // appends v (with w.put for each part)
///   static T read(corpc::Reader& r);                  // reads what write appended, in the same order
/// ```
/// `read` must treat its input as hostile: check what it decodes and throw ProtocolError (the call then fails with
/// it) rather than trust a length or a tag. Both run on the caller's thread (write) or on an I/O or worker thread
/// (read) of the process at hand, never concurrently on one Writer or Reader. The types supported out of the box are
/// listed in corpc/wire/codec.hpp; RRef, RemoteModule and the optimizers' options have codecs in their headers.
template <class T, class Enable = void>
struct Codec;

/// @cond INTERNAL
namespace detail {
// Whether Codec<T> is defined (checked at the use, where a missing one gets one clear error instead of dozens).
template <class T>
inline constexpr bool has_codec = requires {
  sizeof(Codec<T>);
};
}  // namespace detail
/// @endcond

/// Appends the encoding of values to a byte string; what a Codec's `write` receives.
class Writer {
 public:
  /// Appends to `out`, which must outlive the writer.
  explicit Writer(std::string& out) : out_(out) {}
  /// Appends `n` bytes verbatim (for fixed-size data that you lay out yourself, little-endian).
  void raw(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  /// Appends `v` with its Codec (a compile error if `T` has none).
  template <class T>
  void put(const T& v) {
    static_assert(detail::has_codec<T>,
                  "corpc cannot send this type (T, in the instantiation above): give it a codec with CORPC_FIELDS(...) "
                  "in its definition, or specialise corpc::Codec<T> (corpc/wire/codec.hpp)");
    if constexpr (detail::has_codec<T>) Codec<T>::write(*this, v);
  }
  /// The bytes written so far.
  std::string& bytes() noexcept { return out_; }

  /// The message's tensor table, set by the RPC layer: tensors are appended here and encoded as their index. Null
  /// outside an RPC message, where writing a defined tensor throws UsageError.
  std::vector<at::Tensor>* tensors = nullptr;
  void* session = nullptr;  ///< the RPC layer's per-message hooks (RRef forks); opaque here
  int peer = -1;            ///< destination rank

 private:
  std::string& out_;
};

/// Reads encoded values from a byte range, checking every length against what remains; what a Codec's `read`
/// receives. Every shortfall throws ProtocolError.
class Reader {
 public:
  /// Reads the `n` bytes at `p`, which must outlive the reader.
  Reader(const void* p, std::size_t n) : p_(static_cast<const unsigned char*>(p)), end_(p_ + n) {}
  /// Bytes not read yet.
  std::size_t remaining() const noexcept { return static_cast<std::size_t>(end_ - p_); }
  /// Throws ProtocolError unless at least `n` bytes remain.
  void need(std::size_t n) const {
    if (n > remaining())
      throw ProtocolError("truncated payload: need " + std::to_string(n) + " bytes, have " +
                          std::to_string(remaining()));
  }
  /// Copies the next `n` bytes to `dst`; ProtocolError if fewer remain.
  void raw(void* dst, std::size_t n) {
    need(n);
    if (n) std::memcpy(dst, p_, n);
    p_ += n;
  }
  /// The next `n` bytes, in place (valid as long as the buffer is), skipped over; ProtocolError if fewer remain.
  const unsigned char* take(std::size_t n) {
    need(n);
    auto* p = p_;
    p_ += n;
    return p;
  }
  /// Reads a `T` with its Codec.
  template <class T>
  T get() {
    static_assert(
        detail::has_codec<T>,
        "corpc cannot receive this type (T, in the instantiation above): give it a codec with CORPC_FIELDS(...) "
        "in its definition, or specialise corpc::Codec<T> (corpc/wire/codec.hpp)");
    if constexpr (detail::has_codec<T>) return Codec<T>::read(*this);
    else return T{};
  }
  /// A count of elements that each take at least `min_bytes`: rejected if the rest of the payload cannot hold them.
  std::uint32_t count(std::size_t min_bytes = 1) {
    auto n = get<std::uint32_t>();
    if (min_bytes && n > remaining() / min_bytes)
      throw ProtocolError("element count " + std::to_string(n) + " exceeds payload");
    return n;
  }

  /// Elements that encode to no bytes at all (std::monostate, empty tuples) are not paid for by the payload: each
  /// one read is charged to a budget per payload instead, so that a 4-byte count cannot make us build billions.
  static constexpr std::size_t kMaxEmptyElements = std::size_t{1} << 20;
  /// Empty elements this reader may still decode.
  std::size_t empty_budget() const noexcept { return empty_budget_; }
  /// Counts one decoded element that took no bytes; ProtocolError once kMaxEmptyElements are spent. A codec of a
  /// container whose elements may encode to nothing calls it for each such element.
  void charge_empty_element() {
    if (empty_budget_ == 0)
      throw ProtocolError("more than " + std::to_string(kMaxEmptyElements) + " elements that encode to nothing");
    --empty_budget_;
  }

  /// The received message's tensors (set by the RPC layer); decoded tensors are looked up here by index.
  const std::vector<at::Tensor>* tensors = nullptr;
  void* session = nullptr;  ///< the RPC layer's per-message hooks (RRef forks); opaque here
  int peer = -1;            ///< source rank

 private:
  const unsigned char* p_;
  const unsigned char* end_;
  std::size_t empty_budget_ = kMaxEmptyElements;
};

/// Types that have a Codec, i.e. can be sent as arguments and results.
template <class T>
concept Encodable = requires(Writer& w, Reader& r, const T& v) {
  Codec<T>::write(w, v);
  { Codec<T>::read(r) } -> std::convertible_to<T>;
};

/// @cond INTERNAL
// The built-in codecs (listed at the top of this header). Their members are the Codec contract, nothing more.

// ---- scalars --------------------------------------------------------------------------------------------------------
template <class T>
struct Codec<T, std::enable_if_t<std::is_arithmetic_v<T> || std::is_enum_v<T>>> {
  static void write(Writer& w, T v) {
    if constexpr (std::is_same_v<T, bool>) {
      unsigned char b = v ? 1 : 0;
      w.raw(&b, 1);
    } else {
      w.raw(&v, sizeof v);
    }
  }
  static T read(Reader& r) {
    if constexpr (std::is_same_v<T, bool>) {
      unsigned char b;
      r.raw(&b, 1);
      if (b > 1) throw ProtocolError("invalid bool");
      return b == 1;
    } else {
      T v;
      r.raw(&v, sizeof v);
      return v;
    }
  }
};

template <>
struct Codec<std::monostate> {
  static void write(Writer&, std::monostate) {}
  static std::monostate read(Reader&) { return {}; }
};

template <>
struct Codec<std::string> {
  static void write(Writer& w, const std::string& s) {
    w.put(static_cast<std::uint32_t>(s.size()));
    w.raw(s.data(), s.size());
  }
  static std::string read(Reader& r) {
    auto n = r.count(1);
    auto* p = r.take(n);
    return std::string(reinterpret_cast<const char*>(p), n);
  }
};

// ---- containers ----------------------------------------------------------------------------------------------------
template <class T, class A>
struct Codec<std::vector<T, A>> {
  static void write(Writer& w, const std::vector<T, A>& v) {
    w.put(static_cast<std::uint32_t>(v.size()));
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      w.raw(v.data(), v.size() * sizeof(T));
    } else {
      for (const auto& x : v) w.put(x);
    }
  }
  static std::vector<T, A> read(Reader& r) {
    std::vector<T, A> v;
    if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
      auto n = r.count(sizeof(T));
      v.resize(n);
      r.raw(v.data(), n * sizeof(T));
    } else {
      // Elements may encode to zero bytes (monostate): those are charged to the reader's budget for them; the count
      // is never trusted for more than the payload and that budget could hold.
      auto n = r.get<std::uint32_t>();
      if (n > r.remaining() + r.empty_budget()) throw ProtocolError("element count exceeds payload");
      v.reserve(std::min<std::size_t>(n, r.remaining() + 1));
      for (std::uint32_t i = 0; i < n; ++i) {
        const auto before = r.remaining();
        v.push_back(r.get<T>());
        if (r.remaining() == before) r.charge_empty_element();
      }
    }
    return v;
  }
};

template <class T, std::size_t N>
struct Codec<std::array<T, N>> {
  static void write(Writer& w, const std::array<T, N>& a) {
    for (const auto& x : a) w.put(x);
  }
  static std::array<T, N> read(Reader& r) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::array<T, N>{(static_cast<void>(I), r.get<T>())...};  // braced: left to right; T needs no default
    }
    (std::make_index_sequence<N>{});
  }
};

template <class T>
struct Codec<std::optional<T>> {
  static void write(Writer& w, const std::optional<T>& o) {
    w.put(o.has_value());
    if (o) w.put(*o);
  }
  static std::optional<T> read(Reader& r) {
    if (!r.get<bool>()) return std::nullopt;
    return r.get<T>();
  }
};

template <class A, class B>
struct Codec<std::pair<A, B>> {
  static void write(Writer& w, const std::pair<A, B>& p) {
    w.put(p.first);
    w.put(p.second);
  }
  static std::pair<A, B> read(Reader& r) {
    A a = r.get<A>();
    B b = r.get<B>();
    return {std::move(a), std::move(b)};
  }
};

template <class... T>
struct Codec<std::tuple<T...>> {
  static void write(Writer& w, const std::tuple<T...>& t) {
    std::apply([&](const auto&... x) { (w.put(x), ...); }, t);
  }
  static std::tuple<T...> read(Reader& r) {
    return std::tuple<T...>{r.get<T>()...};  // braced init: evaluated left to right
  }
};

namespace detail {
// A variant as a u32 index, then that alternative. Shared by std::variant and c10::variant: `Ops` supplies
// `get<I>(v)` and `make<I>(reader)` for the variant type at hand.
template <class V, class Ops, std::size_t N>
struct VariantCodec {
  static void write(Writer& w, const V& v) {
    const std::size_t index = v.index();
    if (index >= N) throw UsageError("cannot send a variant that is valueless by exception");
    w.put(static_cast<std::uint32_t>(index));
    [&]<std::size_t... I>(std::index_sequence<I...>) { ((index == I ? (w.put(Ops::template get<I>(v)), 0) : 0), ...); }
    (std::make_index_sequence<N>{});
  }
  static V read(Reader& r) {
    const auto index = r.get<std::uint32_t>();
    if (index >= N) throw ProtocolError("variant index " + std::to_string(index) + " out of range");
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      static constexpr V (*alternatives[])(Reader&) = {&Ops::template make<I>...};
      return alternatives[index](r);
    }
    (std::make_index_sequence<N>{});
  }
};

template <class V>
struct StdVariantOps {
  template <std::size_t I>
  static const auto& get(const V& v) {
    return std::get<I>(v);
  }
  template <std::size_t I>
  static V make(Reader& r) {
    return V(std::in_place_index<I>, r.get<std::variant_alternative_t<I, V>>());
  }
};

template <class M>
struct MapCodec {
  using K = typename M::key_type;
  using V = typename M::mapped_type;
  static void write(Writer& w, const M& m) {
    w.put(static_cast<std::uint32_t>(m.size()));
    for (const auto& [k, v] : m) {
      w.put(k);
      w.put(v);
    }
  }
  static M read(Reader& r) {
    auto n = r.count(1);
    M m;
    for (std::uint32_t i = 0; i < n; ++i) {
      K k = r.get<K>();
      m.emplace(std::move(k), r.get<V>());
    }
    return m;
  }
};
}  // namespace detail

template <class K, class V, class C, class A>
struct Codec<std::map<K, V, C, A>> : detail::MapCodec<std::map<K, V, C, A>> {};
template <class K, class V, class H, class E, class A>
struct Codec<std::unordered_map<K, V, H, E, A>> : detail::MapCodec<std::unordered_map<K, V, H, E, A>> {};

template <class... T>
struct Codec<std::variant<T...>>
    : detail::VariantCodec<std::variant<T...>, detail::StdVariantOps<std::variant<T...>>, sizeof...(T)> {};

template <class K, class C, class A>
struct Codec<std::set<K, C, A>> {
  static void write(Writer& w, const std::set<K, C, A>& s) {
    w.put(static_cast<std::uint32_t>(s.size()));
    for (const auto& k : s) w.put(k);
  }
  static std::set<K, C, A> read(Reader& r) {
    auto n = r.count(1);
    std::set<K, C, A> s;
    for (std::uint32_t i = 0; i < n; ++i) s.insert(r.get<K>());
    return s;
  }
};

// ---- user aggregates via CORPC_FIELDS ------------------------------------------------------------------------------
template <class T>
concept HasCorpcFields = requires(T& t) {
  t.corpc_fields();
};

// Each field in order, with its own codec.
template <class T>
struct Codec<T, std::enable_if_t<HasCorpcFields<T>>> {
  static void write(Writer& w, const T& v) {
    std::apply([&](const auto&... f) { (w.put(f), ...); }, const_cast<T&>(v).corpc_fields());
  }
  static T read(Reader& r) {
    T v{};
    std::apply([&](auto&... f) { ((f = r.get<std::decay_t<decltype(f)>>()), ...); }, v.corpc_fields());
    return v;
  }
};
/// @endcond

}  // namespace corpc

/// Inside a struct: lists the members that make up its wire encoding, in order. The struct must be
/// default-constructible.
/// ```cpp
///   struct Point {
///     double x = 0, y = 0;
///     std::string label;
///     CORPC_FIELDS(x, y, label)
///   };
/// ```
/// It defines the member function `corpc_fields()` that the Codec calls, so place it where members are public. Every
/// field named needs a Codec of its own; fields not named are not sent and keep, on the receiver, the values of `T{}`.
#define CORPC_FIELDS(...) \
  auto corpc_fields() { return std::tie(__VA_ARGS__); }
