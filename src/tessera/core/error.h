// Errors with context. Every failure Tessera reports is a tessera::Error whose
// message names what is at fault (the key, file, rank, flag or variable).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A collective or rendezvous that did not complete in time, or a peer that died.
class CommError : public Error {
 public:
  explicit CommError(const std::string& what) : Error(what) {}
};

namespace detail {
inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  format_into(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
}

}  // namespace tessera

// TESSERA_CHECK(cond, "message parts", ...) throws tessera::Error when cond is false.
#define TESSERA_CHECK(cond, ...)                                  \
  do {                                                            \
    if (!(cond)) throw ::tessera::Error(::tessera::concat(__VA_ARGS__)); \
  } while (0)
