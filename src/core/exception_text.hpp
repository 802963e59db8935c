// The text of an exception held in an exception_ptr, for reports that carry errors as words.
#pragma once

#include <exception>
#include <string>

namespace corpc::detail {

inline std::string exception_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace corpc::detail
