// Text and index helpers every layer shares: joined lists and shapes in error
// messages, and the offsets of pieces laid end to end.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::core {

// "a, b, c" (sep between the parts, nothing around them).
inline std::string join(const std::vector<std::string>& parts, const std::string& sep = ", ") {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

// Whether `s` ends with `tail` (a file name's suffix).
inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// "[2, 3]"; "[]" for a scalar's shape.
inline std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Where each of `sizes` starts when they are laid end to end, plus the total at the
// back: {2, 0, 3} -> {0, 2, 2, 5}.
inline std::vector<int64_t> exclusive_offsets(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> off(sizes.size() + 1, 0);
  for (size_t i = 0; i < sizes.size(); ++i) off[i + 1] = off[i] + sizes[i];
  return off;
}

}  // namespace tessera::core
