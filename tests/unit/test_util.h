// Small helpers shared by the unit tests: temporary directories, whole-file I/O,
// running a shell command, and catching an error's message.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>

#include "tessera/core/error.h"

namespace tessera::testing {

// A fresh directory under /tmp (left in place for post-mortems).
inline std::string temp_dir(const std::string& prefix = "tessera-test") {
  std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
  const char* d = ::mkdtemp(tmpl.data());
  EXPECT_NE(d, nullptr) << "mkdtemp failed";
  return tmpl;
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

// Runs `cmd` through the shell; returns its exit status (128+signal when killed) and
// its stdout and stderr together.
inline std::pair<int, std::string> run_command(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int st = ::pclose(p);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

// The message of the tessera::Error `f` throws, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace tessera::testing

#define EXPECT_CONTAINS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)
