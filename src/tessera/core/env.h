// Environment variables: one table of every TESSERA_* variable (name, type, default, who
// sets it, meaning), and strict parsing: a malformed value is an error that names the
// variable, never a silent default.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::env {

// Who sets a variable: the user, Tessera itself for the processes it starts, or a test.
enum class SetBy { User, Tessera, Test };

struct Variable {
  const char* name;
  const char* type;           // "bool", "int", "string", "path", or its values ("a|b")
  const char* default_value;  // "" when unset means no value, or the program's own choice
  SetBy set_by;
  const char* meaning;
};

// The table (src/tessera/core/env.cpp), which docs/cli.md's list repeats.
const std::vector<Variable>& variables();

// The table's row for `name`; throws tessera::Error naming the table when there is none.
const Variable& variable(const std::string& name);

// The variable's value, or nullopt when unset. An empty value counts as unset. A TESSERA_*
// name must be in the table (variable()).
std::optional<std::string> get(const std::string& name);

// Parses a base-10 integer in [min, max]; throws tessera::Error naming `name` otherwise.
std::optional<int64_t> get_int(const std::string& name, int64_t min = INT64_MIN, int64_t max = INT64_MAX);

// "1/true/yes/on" and "0/false/no/off" (any case); anything else is an error naming `name`.
std::optional<bool> get_bool(const std::string& name);

// Parses `text` as an integer in [min, max]; `what` names the source in the error.
int64_t parse_int(const std::string& text, const std::string& what, int64_t min = INT64_MIN,
                  int64_t max = INT64_MAX);

}  // namespace tessera::env
