#include "tessera/core/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "tessera/core/error.h"

namespace tessera::env {

std::optional<std::string> get(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int64_t parse_int(const std::string& text, const std::string& what, int64_t min, int64_t max) {
  std::string t = text;
  while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
  size_t start = 0;
  while (start < t.size() && std::isspace(static_cast<unsigned char>(t[start]))) ++start;
  t = t.substr(start);
  TESSERA_CHECK(!t.empty(), what, " is empty; expected an integer");
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(t.c_str(), &end, 10);
  TESSERA_CHECK(errno == 0 && end != nullptr && *end == '\0', what, "='", text,
                "' is not an integer");
  TESSERA_CHECK(v >= min && v <= max, what, "=", v, " is out of range [", min, ", ", max, "]");
  return v;
}

std::optional<int64_t> get_int(const std::string& name, int64_t min, int64_t max) {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_int(*v, name, min, max);
}

std::optional<bool> get_bool(const std::string& name) {
  auto v = get(name);
  if (!v) return std::nullopt;
  std::string s = *v;
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  if (s == "1" || s == "true" || s == "yes" || s == "on") return true;
  if (s == "0" || s == "false" || s == "no" || s == "off") return false;
  throw Error(concat(name, "='", *v, "' is not a boolean (use 1/0, true/false, yes/no, on/off)"));
}

}  // namespace tessera::env
