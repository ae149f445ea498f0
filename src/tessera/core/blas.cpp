#include "tessera/core/blas.h"
#include "tessera/core/env.h"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tessera::core {

namespace {
// Set (to the value chosen) by blas_preinit when it set OPENBLAS_CORETYPE itself.
constexpr const char* kSetByTessera = "TESSERA_BLAS_KERNELS_SET";
}  // namespace

const char* openblas_coretype_for_this_cpu() {
  __builtin_cpu_init();  // needed this early (before constructors)
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return "Cooperlake";
  if (avx512) return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return "";
}

// The C library's own initialiser, which runs after the executable's .preinit_array,
// resets the environment to the one the process started with, so a setenv() here would
// be lost before OpenBLAS reads it. Instead the process starts itself again, once, with
// the two variables added (execve keeps the pid, the open files, the arguments and, with
// the path chosen below, the program's name); the second start finds OPENBLAS_CORETYPE set
// and goes on. No allocation: static buffers.
void blas_preinit(int, char** argv, char** envp) {
  if (argv == nullptr || envp == nullptr) return;
  // The C library's getenv() cannot be used yet (its environment pointer is set by the
  // initialiser that runs after this): read `envp` itself.
  auto has = [envp](const char* entry) {
    const size_t len = std::strlen(entry);
    for (char** e = envp; *e != nullptr; ++e)
      if (std::strncmp(*e, entry, len) == 0) return true;
    return false;
  };
  bool off = false;
  for (char** e = envp; *e != nullptr; ++e) off = off || std::strcmp(*e, "TESSERA_BLAS_KERNELS=default") == 0;
  // The marker: this process was started again by this function already (never loop).
  if (off || has("OPENBLAS_CORETYPE=") || has("TESSERA_BLAS_KERNELS_SET=")) return;
  // Under valgrind the new image would run outside it (valgrind does not follow exec by
  // default): profile with OPENBLAS_CORETYPE set instead.
  for (char** e = envp; *e != nullptr; ++e)
    if (std::strncmp(*e, "LD_PRELOAD=", 11) == 0 && std::strstr(*e, "vgpreload") != nullptr) return;
  const char* best = openblas_coretype_for_this_cpu();
  if (*best == '\0') return;
  static char coretype[64], marker[96];
  static char* env[4096];
  std::snprintf(coretype, sizeof coretype, "OPENBLAS_CORETYPE=%s", best);
  std::snprintf(marker, sizeof marker, "%s=%s", kSetByTessera, best);
  size_t n = 0;
  for (char** e = envp; *e != nullptr; ++e) {
    if (n + 3 >= sizeof env / sizeof env[0]) return;  // an environment this large: leave it
    env[n++] = *e;
  }
  env[n++] = coretype;
  env[n++] = marker;
  env[n] = nullptr;
  // The kernel names the new image (/proc/PID/comm: what ps, top and pgrep show) after
  // the last part of the path given to execve, so "/proc/self/exe" would rename every
  // program "exe". The path the program was started by, when argv[0] is one and is still
  // this very file (a symlink named otherwise keeps its name, as it had); else the
  // executable's real path; "/proc/self/exe" only when neither can be run (a file deleted
  // or replaced since it started). argv itself is passed on unchanged.
  struct stat self {}, named {};
  if (argv[0] != nullptr && std::strchr(argv[0], '/') != nullptr && ::stat("/proc/self/exe", &self) == 0 &&
      ::stat(argv[0], &named) == 0 && named.st_dev == self.st_dev && named.st_ino == self.st_ino)
    ::execve(argv[0], argv, env);  // returns only on failure: try the next
  static char real[4096];
  const ssize_t len = ::readlink("/proc/self/exe", real, sizeof real - 1);
  if (len > 0) {
    real[len] = '\0';
    ::execve(real, argv, env);
  }
  ::execve("/proc/self/exe", argv, env);  // returns only on failure: go on as we are
}

std::string blas_summary() {
  using CoreName = char* (*)();
  auto corename = reinterpret_cast<CoreName>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (corename == nullptr) return "no OpenBLAS in this process";
  const std::string name = corename();
  std::string s = "OpenBLAS " + name + " kernels";
  const char* forced = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> by_us = env::get(kSetByTessera);
  const std::string best = openblas_coretype_for_this_cpu();
  if (forced != nullptr) {
    s += std::string(" (OPENBLAS_CORETYPE=") + forced +
         (by_us == std::string(forced) ? ", set by Tessera)" : ")");
  } else if (!best.empty() && name != best && (name == "Prescott" || name == "Core2" || name == "Nehalem" ||
                                               name == "Sandybridge" || name == "Atom")) {
    s += " (generic; this CPU supports " + best + ": see tessera/core/blas.h)";
  }
  return s;
}

}  // namespace tessera::core
