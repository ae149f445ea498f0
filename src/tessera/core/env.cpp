#include "tessera/core/env.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "tessera/core/error.h"

namespace tessera::env {

const std::vector<Variable>& variables() {
  // Sorted by who sets it, then by name. docs/cli.md, "Environment variables", lists the same
  // rows (tests/core/test_env.cpp compares them).
  static const std::vector<Variable> table = {
      {"TESSERA_BLAS_KERNELS", "default", "tuned", SetBy::User,
       "`default` keeps OpenBLAS's own kernel choice instead of the startup tuning (core/blas.h)"},
      {"TESSERA_CKPT_CRC", "package|python", "", SetBy::User,
       "the Python package's CRC32C: google-crc32c's, or its own pure-Python one (default: google-crc32c's where installed)"},
      {"TESSERA_CPU_ALLOCATOR", "caching|system", "caching", SetBy::User,
       "CPU tensor allocator of the programs: Tessera's cache, or c10's (sanitized builds: system)"},
      {"TESSERA_CPU_CACHE_MIB", "int", "", SetBy::User, "cap on the idle bytes the CPU cache keeps, in MiB"},
      {"TESSERA_FULL_SAVE_ONE_WRITER", "bool", "0", SetBy::User,
       "a consolidated save is written by rank 0 alone, even where several ranks could write"},
      {"TESSERA_FULL_SAVE_READ_BACK", "all|edges", "", SetBy::User,
       "what a consolidated save with several writers reads back of another rank's bytes (default: "
       "edges with one BLAS kernel set, else all)"},
      {"TESSERA_GLOO_NATIVE", "bool", "", SetBy::User,
       "Gloo's own collectives instead of Tessera's over the shared-memory channel (default: the program's)"},
      {"TESSERA_LOG_LEVEL", "debug|info|warn|error", "warn", SetBy::User, "the library's log level"},
      {"TESSERA_NO_DIRECT_IO", "bool", "0", SetBy::User, "1 reads and writes checkpoints through the page cache"},
      {"TESSERA_RDZV_TOKEN", "string", "", SetBy::User,
       "the rendezvous token itself (see \"Who may reach the rendezvous store\")"},
      {"TESSERA_RDZV_TOKEN_FILE", "path", "", SetBy::User, "a file holding the rendezvous token"},
      {"TESSERA_SHM", "bool", "", SetBy::User,
       "the shared-memory channel between ranks of one node (default: the program's, on)"},
      {"TESSERA_BLAS_KERNELS_SET", "string", "", SetBy::Tessera,
       "set by the startup tuning before it re-executes the program: the kernel set it chose"},
      {"TESSERA_LAUNCHED", "1", "", SetBy::Tessera, "set by tessera run for its ranks"},
      {"TESSERA_RESTART_COUNT", "int", "", SetBy::Tessera,
       "set by tessera run: the restart round (as TORCHELASTIC_RESTART_COUNT)"},
      {"TESSERA_TTY_COLUMNS", "int", "", SetBy::Tessera,
       "set by tessera run when a terminal shows a rank's output: the columns after its prefix"},
      {"TESSERA_SEED", "int", "20261130", SetBy::Test, "the reliability tests' random seed"},
      {"TESSERA_SOAK", "0|1", "0", SetBy::Test, "the reliability tests' long counts (make soak)"},
      {"TESSERA_TEST_FS_TYPE", "int", "", SetBy::Test, "replaces statfs's f_type when a save asks what filesystem it is on"},
      {"TESSERA_TEST_IO_PAGE_SIZE", "int", "", SetBy::Test,
       "replaces the page size direct I/O aligns to (a power of two, at least 4096)"},
      {"TESSERA_TEST_PAUSE_BEFORE_COMMIT", "0|1", "0", SetBy::Test,
       "1 makes an offline tool stop before it publishes its output"},
      {"TESSERA_TEST_SAVE_FAULT", "RANK:WHAT", "", SetBy::Test, "a fault a save injects on one rank"},
      {"TESSERA_TEST_SHM_CHUNK", "int", "", SetBy::Test, "the test worker's shared-memory chunk size in bytes"},
      {"TESSERA_TEST_TIMEOUT_MS", "int", "30000", SetBy::Test, "the test worker's collective timeout"},
  };
  return table;
}

const Variable& variable(const std::string& name) {
  for (const Variable& v : variables())
    if (name == v.name) return v;
  throw Error(concat("internal error: ", name, " is read but is not in the table of environment variables "
                     "(src/tessera/core/env.cpp, docs/cli.md)"));
}

std::optional<std::string> get(const std::string& name) {
  if (name.rfind("TESSERA_", 0) == 0) variable(name);  // Tessera's own: listed, or an error
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
