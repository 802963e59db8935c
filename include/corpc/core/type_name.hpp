/// @file
/// Compile-time names for types and functions.
///
/// Function keys on the wire are derived from the function's own name, as the compiler spells it, so ranks that run the
/// same binary agree on them without any registration. Different compilers may spell names differently: processes
/// built by different compilers must register functions under explicit names (see corpc/rpc/registry.hpp).
#pragma once

#include <cstdint>
#include <string_view>

namespace corpc {

namespace detail {
template <class T>
constexpr std::string_view raw_type_name() {
  return __PRETTY_FUNCTION__;
}
template <auto F>
constexpr std::string_view raw_value_name() {
  return __PRETTY_FUNCTION__;
}
// GCC prints "... [with T = X; std::string_view = ...]", Clang "... [T = X]": take X, from the first " = " after
// the opening bracket up to the next ';' or ']' at bracket depth zero.
constexpr std::string_view between_eq_and_bracket(std::string_view s) {
  const auto open = s.find('[');
  if (open == std::string_view::npos) return s;
  const auto eq = s.find(" = ", open);
  if (eq == std::string_view::npos) return s;
  const auto begin = eq + 3;
  int depth = 0;
  for (auto i = begin; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '<' || c == '(' || c == '[') ++depth;
    else if ((c == '>' || c == ')') && depth > 0) --depth;
    else if (c == ']' && depth > 0) --depth;
    else if ((c == ';' || c == ']') && depth == 0) return s.substr(begin, i - begin);
  }
  return s.substr(begin);
}
}  // namespace detail

/// The name of type `T` as the compiler spells it ("std::vector<int>"), at compile time. consteval: a call on a
/// hot path must not parse the compiler's text at run time, which a constexpr function called there may do.
template <class T>
consteval std::string_view type_name() {
  return detail::between_eq_and_bracket(detail::raw_type_name<T>());
}

/// The name of F, a function pointer or member function pointer constant, as the compiler spells it ("add",
/// "Shard1::forward", "ns::f"), at compile time: what rpc_async puts on the wire for `rpc_async<&f>`.
template <auto F>
consteval std::string_view function_name() {
  std::string_view s = detail::between_eq_and_bracket(detail::raw_value_name<F>());
  if (!s.empty() && s.front() == '&') s.remove_prefix(1);
  return s;
}

/// The 64-bit FNV-1a hash of `s` (continuing from `h`), at compile time: the hash behind function ids.
constexpr std::uint64_t fnv1a(std::string_view s, std::uint64_t h = 14695981039346656037ull) {
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace corpc
