// core/blas.h: Tessera's programs choose OpenBLAS's kernels for this CPU before OpenBLAS
// loads (TESSERA_TUNE_BLAS_AT_STARTUP), leave a user's OPENBLAS_CORETYPE alone, and
// TESSERA_BLAS_KERNELS=default turns the choice off. Checked on the gpt example's report
// of the kernels it ran with, against what this CPU and this process's BLAS allow.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <string>

#include "support/test_util.h"
#include "tessera/core/blas.h"

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
