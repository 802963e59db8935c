// A small strict JSON reader, enough to check and draw Chrome traces (tests/test_trace.cpp, tools/corpc_trace.cpp)
// without a Python or library dependency. Throws std::runtime_error (with the offset) on anything that is not JSON.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace mini_json {

struct Value;
using Array = std::vector<Value>;
using Object = std::map<std::string, Value>;

struct Value {
  std::variant<std::nullptr_t, bool, double, std::string, std::shared_ptr<Array>, std::shared_ptr<Object>> v;

  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_number() const { return std::holds_alternative<double>(v); }
  bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(v); }
  bool is_array() const { return std::holds_alternative<std::shared_ptr<Array>>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
  double num() const { return std::get<double>(v); }
  const Array& arr() const { return *std::get<std::shared_ptr<Array>>(v); }
  const Object& obj() const { return *std::get<std::shared_ptr<Object>>(v); }
  // A member of an object, or null when absent (or when this is not an object).
  const Value& operator[](const std::string& key) const {
    static const Value null;
    if (!is_object()) return null;
    auto it = obj().find(key);
    return it == obj().end() ? null : it->second;
  }
  std::string string_or(std::string fallback) const { return is_string() ? str() : fallback; }
  double number_or(double fallback) const { return is_number() ? num() : fallback; }
};

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}
  Value parse() {
    Value v = value();
    space();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  Value value() {
    space();
    if (i_ >= s_.size()) fail("unexpected end");
    const char c = s_[i_];
    if (c == '{') return object();
    if (c == '[') return array();
    if (c == '"') return Value{string()};
    if (word("true")) return Value{true};
    if (word("false")) return Value{false};
    if (word("null")) return Value{nullptr};
    return Value{number()};
  }
  Value object() {
    expect('{');
    auto o = std::make_shared<Object>();
    if (!eat('}')) {
      do {
        space();
        if (i_ >= s_.size() || s_[i_] != '"') fail("expected a key");
        std::string key = string();
        expect(':');
        (*o)[key] = value();
      } while (eat(','));
      expect('}');
    }
    return Value{o};
  }
  Value array() {
    expect('[');
    auto a = std::make_shared<Array>();
    if (!eat(']')) {
      do a->push_back(value());
      while (eat(','));
      expect(']');
    }
    return Value{a};
  }
  std::string string() {
    ++i_;  // the opening quote
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unexpected end in an escape");
      c = s_[i_++];
      switch (c) {
        case '"':
        case '\\':
        case '/': out += c; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          const unsigned code = static_cast<unsigned>(std::strtoul(std::string(s_.substr(i_, 4)).c_str(), nullptr, 16));
          i_ += 4;
          if (code < 0x80) out += static_cast<char>(code);
          else out += '?';  // enough for checking and drawing
          break;
        }
        default: fail("bad escape");
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }
  double number() {
    const std::size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    bool digits = false;
    while (i_ < s_.size() && std::string_view("0123456789.eE+-").find(s_[i_]) != std::string_view::npos)
      ++i_, digits = true;
    if (!digits) fail("expected a value");
    const std::string text(s_.substr(start, i_ - start));
    char* end = nullptr;
    const double d = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size()) fail("bad number");
    return d;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

inline Value parse(std::string_view text) { return Parser(text).parse(); }

}  // namespace mini_json
