// Small helpers shared by the unit tests: a launcher-free environment, temporary directories (removed after a test
// that passes, see temp_dirs.cpp), whole-file I/O, running a shell command, and catching
// an error's message.
#pragma once
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::testing {

// A shell prefix that runs a command outside any launcher environment the test itself may
// have inherited (torchrun's, tessera run's, SLURM's and Open MPI's variables unset), so
// that a program that launches its own ranks does so.
inline const std::string kNoLauncherEnv =
    "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u TESSERA_LAUNCHED "
    "-u SLURM_PROCID -u SLURM_NTASKS -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE ";

// The directories temp_dir() made in this process that the running test has not yet
// disposed of: one registry for every translation unit (an inline function's static).
struct TempDirRegistry {
  std::mutex mu;
  std::vector<std::string> paths;
};

inline TempDirRegistry& temp_dir_registry() {
  static TempDirRegistry registry;
  return registry;
}

inline void register_temp_dir(const std::string& path) {
  TempDirRegistry& r = temp_dir_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.paths.push_back(path);
}

// The registered directories, emptying the registry.
inline std::vector<std::string> take_temp_dirs() {
  TempDirRegistry& r = temp_dir_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> paths;
  paths.swap(r.paths);
  return paths;
}

// A fresh directory <parent>/<prefix>-XXXXXX (mkdtemp), registered: when the running test
// ends, the listener in temp_dirs.cpp removes it if the test did not fail, and keeps it
// for a post-mortem (naming it on stderr) if it did. Throws when mkdtemp fails.
inline std::string temp_dir(const std::string& prefix = "tessera-test", const std::string& parent = "/tmp") {
  const std::string tmpl = parent + "/" + prefix + "-XXXXXX";
  std::string path = tmpl;
  if (!::mkdtemp(path.data())) {
    const int err = errno;
    throw std::runtime_error("mkdtemp(" + tmpl + ") failed: " + std::strerror(err));
  }
  register_temp_dir(path);
  return path;
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
