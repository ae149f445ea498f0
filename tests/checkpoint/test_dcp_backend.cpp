// tessera_ckpt.dcp (issue 36 item 1): PyTorch 2.x's own dcp.save / dcp.load through
// Tessera's StorageWriter / StorageReader, at 1, 2 and 3 ranks on Gloo, both ways, with
// FSDP2 (fully_shard) models and AdamW state bit-exact, the v1 fixture and v2 layouts read
// into DTensors, and every written checkpoint accepted by `tessera ckpt verify`
// (tests/python/dcp_backend_check.py). Compiled only where the tests' Python has
// torch.distributed.checkpoint (the torch 2.x build, make test-torch2).
#include <gtest/gtest.h>

#include "tessera_tests/python_features.h"

#if TESSERA_PYTHON_HAS_DCP

#include <string>

#include "support/test_util.h"

TEST(DcpBackend, DcpSavesAndLoadsTesseraCheckpointsAtOneTwoAndThreeRanks) {
  const std::string cmd = tessera::testing::kNoLauncherEnv + std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                          "/tests/python/dcp_backend_check.py --tessera " + TESSERA_CLI;
  auto [rc, out] = tessera::testing::run_command(cmd);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok dcp_backend_check:"), std::string::npos) << out;
}

#endif  // TESSERA_PYTHON_HAS_DCP
