/// @file
/// The small torch value types that functions and module options take: c10::Scalar,
/// c10::Device, at::ScalarType, c10::optional, c10::variant, and the option tags (torch::kSum, torch::kMean, ...).
///
/// Options hold optionals and variants of torch's tags: libtorch 1.13's own c10::optional and c10::variant, or from 2.x
/// std's (which codec.hpp covers; see corpc/detail/torch_compat.hpp):
/// ```cpp
///   torch::nn::EmbeddingBagOptions(10, 3).mode(torch::kSum).max_norm(1.0)   // a variant and an optional
/// ```
/// so with these a Codec for an options struct is a list of its fields (see tests/test_porting.cpp for one).
///
/// Decoding checks every tag against what it may be: an unknown scalar kind, device type or dtype is a ProtocolError.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Scalar.h>
#include <c10/core/ScalarType.h>

#include <complex>
#include <string_view>

#include "corpc/core/type_name.hpp"
#include "corpc/detail/torch_compat.hpp"
#include "corpc/wire/codec.hpp"

namespace corpc {

/// @cond INTERNAL
// The codecs themselves: their members are the Codec contract (corpc/wire/codec.hpp), nothing more.

template <>
struct Codec<c10::ScalarType> {
  static void write(Writer& w, c10::ScalarType t) { w.put(static_cast<std::int8_t>(t)); }
  static c10::ScalarType read(Reader& r) {
    const auto v = r.get<std::int8_t>();
    if (v < 0 || v >= static_cast<std::int8_t>(c10::ScalarType::NumOptions))
      throw ProtocolError("unknown scalar type " + std::to_string(v));
    return static_cast<c10::ScalarType>(v);
  }
};

template <>
struct Codec<c10::Device> {
  static void write(Writer& w, const c10::Device& d) {
    w.put(static_cast<std::int8_t>(d.type()));
    w.put(static_cast<std::int8_t>(d.index()));
  }
  static c10::Device read(Reader& r) {
    const auto type = r.get<std::int8_t>();
    const auto index = r.get<std::int8_t>();
    if (type < 0 || type >= static_cast<std::int8_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES) ||
        !c10::isValidDeviceType(static_cast<c10::DeviceType>(type)))
      throw ProtocolError("unknown device type " + std::to_string(type));
    // What Device's own constructor asserts, checked first so that a bad payload is a ProtocolError.
    if (index < -1 || (type == static_cast<std::int8_t>(c10::DeviceType::CPU) && index > 0))
      throw ProtocolError("invalid device index " + std::to_string(index));
    return c10::Device(static_cast<c10::DeviceType>(type), index);
  }
};

// A number as one of its four kinds; symbolic scalars (tracing) cannot be sent.
template <>
struct Codec<c10::Scalar> {
  enum Kind : std::uint8_t { kDouble, kLong, kComplex, kBool };
  static void write(Writer& w, const c10::Scalar& s) {
    if (s.isSymbolic()) throw UsageError("a symbolic c10::Scalar cannot be sent");
    if (s.isBoolean()) {
      w.put(std::uint8_t{kBool});
      w.put(s.toBool());
    } else if (s.isIntegral(false)) {
      w.put(std::uint8_t{kLong});
      w.put(s.toLong());
    } else if (s.isComplex()) {
      const auto z = s.toComplexDouble();
      w.put(std::uint8_t{kComplex});
      w.put(z.real());
      w.put(z.imag());
    } else {
      w.put(std::uint8_t{kDouble});
      w.put(s.toDouble());
    }
  }
  static c10::Scalar read(Reader& r) {
    switch (r.get<std::uint8_t>()) {
      case kDouble: return c10::Scalar(r.get<double>());
      case kLong: return c10::Scalar(r.get<std::int64_t>());
      case kComplex: {
        const double re = r.get<double>();
        return c10::Scalar(c10::complex<double>(re, r.get<double>()));
      }
      case kBool: return c10::Scalar(r.get<bool>());
      default: throw ProtocolError("unknown c10::Scalar kind");
    }
  }
};

template <class T>
  requires detail::c10_optional_is_own_type<T>
struct Codec<c10::optional<T>> {
  static void write(Writer& w, const c10::optional<T>& o) {
    w.put(o.has_value());
    if (o) w.put(*o);
  }
  static c10::optional<T> read(Reader& r) {
    if (!r.get<bool>()) return c10::nullopt;
    return r.get<T>();
  }
};

namespace detail {
#if CORPC_C10_HAS_OWN_VARIANT
template <class V>
struct C10VariantOps {
  template <std::size_t I>
  static const auto& get(const V& v) {
    return c10::get<I>(v);
  }
  template <std::size_t I>
  static V make(Reader& r) {
    return V(c10::in_place_index_t<I>(), r.get<c10::variant_alternative_t<I, V>>());
  }
};
#endif

// torch::kSum, torch::kMean, ...: empty tag types that options hold in variants; they encode to nothing (the
// variant's index says which one it is).
template <class T>
constexpr bool is_torch_enum_tag() {
  constexpr std::string_view prefix = "torch::enumtype::k";
  return std::is_empty_v<T> && std::is_default_constructible_v<T> && type_name<T>().substr(0, prefix.size()) == prefix;
}
}  // namespace detail

#if CORPC_C10_HAS_OWN_VARIANT
template <class... T>
struct Codec<c10::variant<T...>>
    : detail::VariantCodec<c10::variant<T...>, detail::C10VariantOps<c10::variant<T...>>, sizeof...(T)> {};
#endif

template <class T>
struct Codec<T, std::enable_if_t<detail::is_torch_enum_tag<T>()>> {
  static void write(Writer&, const T&) {}
  static T read(Reader&) { return T{}; }
};
/// @endcond

}  // namespace corpc
