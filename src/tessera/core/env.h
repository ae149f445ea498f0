// Strict parsing of environment variables: a malformed value is an error that
// names the variable, never a silent default.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace tessera::env {

// The variable's value, or nullopt when unset. An empty value counts as unset.
std::optional<std::string> get(const std::string& name);

// Parses a base-10 integer in [min, max]; throws tessera::Error naming `name` otherwise.
std::optional<int64_t> get_int(const std::string& name, int64_t min = INT64_MIN, int64_t max = INT64_MAX);

// "1/true/yes/on" and "0/false/no/off" (any case); anything else is an error naming `name`.
std::optional<bool> get_bool(const std::string& name);

// Parses `text` as an integer in [min, max]; `what` names the source in the error.
int64_t parse_int(const std::string& text, const std::string& what, int64_t min = INT64_MIN,
                  int64_t max = INT64_MAX);

}  // namespace tessera::env
