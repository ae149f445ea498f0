// core/blas.h: Tessera's programs choose OpenBLAS's kernels for this CPU before OpenBLAS
// loads (TESSERA_TUNE_BLAS_AT_STARTUP), leave a user's OPENBLAS_CORETYPE alone, and
// TESSERA_BLAS_KERNELS=default turns the choice off. Checked on the gpt example's report
// of the kernels it ran with, against what this CPU and this process's BLAS allow. The
// restart keeps the program's name: a running gpt is "gpt" in /proc/PID/comm (ps, top,
// pgrep), not "exe".
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "tessera/core/blas.h"

using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;

namespace {
// The `blas="..."` part of gpt's host line after a two-step run under `env`.
std::string gpt_blas(const std::string& env) {
  const std::string out = temp_dir("tessera-blas");
  auto [rc, text] = run_command(env + " OMP_NUM_THREADS=1 " + std::string(TESSERA_BINARY_DIR) +
                                "/bin/gpt train --strategy single --max-steps 2 --batch-size 2 --seq-len 8 "
                                "--n-layer 1 --n-head 1 --d-model 8 --val-fraction 0 --no-progress-bar --out " +
                                out + "/run");
  EXPECT_EQ(rc, 0) << text;
  const auto at = text.find("blas=\"");
  if (at == std::string::npos) {
    ADD_FAILURE() << "no blas= in gpt's output:\n" << text;
    return "";
  }
  return text.substr(at + 6, text.find('"', at + 6) - at - 6);
}
}  // namespace

TEST(Blas, ProgramsChooseOpenBlasKernelsForThisCpu) {
  // This test binary links the same libtorch (and so the same BLAS) as gpt.
  const bool openblas = ::dlsym(RTLD_DEFAULT, "openblas_get_corename") != nullptr;
  const std::string best = tessera::core::openblas_coretype_for_this_cpu();
  const std::string chosen = gpt_blas("env -u OPENBLAS_CORETYPE -u TESSERA_BLAS_KERNELS");
  if (!openblas) {
    EXPECT_EQ(chosen, "no OpenBLAS in this process");
  } else if (best.empty()) {
    EXPECT_EQ(chosen.find("set by Tessera"), std::string::npos) << chosen;
  } else {
    EXPECT_EQ(chosen, "OpenBLAS " + best + " kernels (OPENBLAS_CORETYPE=" + best + ", set by Tessera)");
  }
  // A user's choice stands, and the choice can be turned off.
  const std::string user = gpt_blas("OPENBLAS_CORETYPE=Haswell");
  if (openblas) EXPECT_EQ(user, "OpenBLAS Haswell kernels (OPENBLAS_CORETYPE=Haswell)");
  const std::string off = gpt_blas("env -u OPENBLAS_CORETYPE TESSERA_BLAS_KERNELS=default");
  EXPECT_EQ(off.find("OPENBLAS_CORETYPE"), std::string::npos) << off;
}

// issue 44, item 10: the restart executed /proc/self/exe, and the kernel names a process
// after the file it executes, so every rank was "exe" in ps, top and pgrep. A real gpt
// started three ways (its path, a symlink by another name, a bare name found on PATH by
// a shell's exec) is read from /proc/PID while it trains: comm is the name it was started
// by, cmdline its original arguments, and its environment shows the restart happened.
TEST(Blas, RestartKeepsTheProgramsName) {
  const std::string best = tessera::core::openblas_coretype_for_this_cpu();
  if (best.empty()) GTEST_SKIP() << "no kernel set to choose on this CPU: the program is not restarted";
  namespace fs = std::filesystem;
  const std::string bin = std::string(TESSERA_BINARY_DIR) + "/bin";
  const std::string gpt = bin + "/gpt";
  if (!fs::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-blas-name");
  const std::string alias = dir + "/my-gpt";
  fs::create_symlink(gpt, alias);
  const std::string args = " train --strategy single --max-steps 1000000 --batch-size 2 --seq-len 8 --n-layer 1 "
                           "--n-head 1 --d-model 8 --val-fraction 0 --no-progress-bar --threads 1 --out ";
  struct Case {
    std::vector<std::string> argv;
    std::string comm, argv0;
  };
  const std::vector<Case> cases = {
      {{gpt}, "gpt", gpt},
      {{alias}, "my-gpt", alias},
      {{"/bin/sh", "-c", "export PATH=" + bin + ":$PATH; exec gpt"}, "gpt", "gpt"},
  };
  // What the restart looks for, and the launchers' variables (gpt would wait for ranks).
  auto drop = [](const std::string& name) {
    for (const char* v : {"OPENBLAS_CORETYPE", "TESSERA_BLAS_KERNELS", "TESSERA_BLAS_KERNELS_SET", "RANK", "WORLD_SIZE",
                          "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TESSERA_LAUNCHED",
                          "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"})
      if (name == v) return true;
    return false;
  };
  int n = 0;
  for (Case c : cases) {
    const std::string out = dir + "/run" + std::to_string(n++);
    if (c.argv.size() == 1) {
      std::istringstream words(args + out);
      for (std::string w; words >> w;) c.argv.push_back(w);
    } else {
      c.argv.back() += args + out;
    }
    SCOPED_TRACE(c.argv.back());
    tessera::testing::Child p = tessera::testing::spawn(c.argv, {{"OMP_NUM_THREADS", "1"}}, drop);
    ASSERT_GT(p.pid, 0);
    // Past the restart and into training: gpt's report of its data comes after setup.
    const bool started = p.wait_for(" training / ", 120000);
    const std::string proc = "/proc/" + std::to_string(p.pid);
    const std::string comm = read_bytes(proc + "/comm");
    const std::string cmdline = read_bytes(proc + "/cmdline");
    const std::string environ_ = read_bytes(proc + "/environ");
    ::kill(p.pid, SIGKILL);
    EXPECT_NE(p.wait_exit(60000), -1);
    ASSERT_TRUE(started) << p.text;
    EXPECT_EQ(comm, c.comm + "\n");
    EXPECT_EQ(cmdline.substr(0, cmdline.find('\0')), c.argv0);
    EXPECT_NE(cmdline.find(std::string("\0--out\0", 7) + out), std::string::npos) << cmdline;
    EXPECT_NE(environ_.find("TESSERA_BLAS_KERNELS_SET=" + best), std::string::npos) << "not restarted";
  }
}
