// tessera_ckpt.dcp (issue 36 item 1): PyTorch 2.x's own dcp.save / dcp.load through
// Tessera's StorageWriter / StorageReader, at 1, 2 and 3 ranks on Gloo, both ways, with
// FSDP2 (fully_shard) models and AdamW state bit-exact, the v1 fixture and v2 layouts read
// into DTensors, and every written checkpoint accepted by `tessera ckpt verify`
// (tests/python/dcp_backend_check.py). Compiled only where the tests' Python has
// torch.distributed.checkpoint (the torch 2.x build, make test-torch2).
#include <gtest/gtest.h>

#include "tessera_tests/python_features.h"

#if TESSERA_PYTHON_HAS_DCP

#include <cmath>
#include <filesystem>
#include <string>

#include "support/test_util.h"

using tessera::testing::kNoLauncherEnv;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;

TEST(DcpBackend, DcpSavesAndLoadsTesseraCheckpointsAtOneTwoAndThreeRanks) {
  const std::string cmd = tessera::testing::kNoLauncherEnv + std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                          "/tests/python/dcp_backend_check.py --tessera " + TESSERA_CLI;
  auto [rc, out] = tessera::testing::run_command(cmd);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok dcp_backend_check:"), std::string::npos) << out;
}

// The GPT of examples/gpt in PyTorch (tests/python/gpt_dcp_peer.py: the same architecture
// and parameter names, random weights), sharded by FSDP2 over 2 ranks and saved with
// dcp.save through tessera_ckpt.dcp.Writer, is a Tessera checkpoint as it is: `tessera ckpt
// verify` accepts it, and `gpt train --init-from` on it (FSDP, 2 ranks, no import step) starts
// with the loss Python computed with those weights on the same window.
TEST(DcpBackend, GptStartsFromAnFsdp2ModelSavedThroughTheWriter) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!std::filesystem::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-dcp-writer-gpt");
  const std::string text = dir + "/text.txt";
  std::string pattern;
  for (int i = 0; i < 800; ++i) pattern += "shard tensor ok!\n";  // 17 bytes = --seq-len: every window alike
  write_bytes(text, pattern);
  const std::string peer = std::string(TESSERA_SOURCE_DIR) + "/tests/python/gpt_dcp_peer.py";
  auto [rc, out] = run_command(kNoLauncherEnv + std::string(TESSERA_CLI) + " run -n 2 -- " + TESSERA_PYTHON + " " +
                               peer + " " + text + " " + dir + " 2 2 32 17 tessera");
  ASSERT_EQ(rc, 0) << out;
  const double want = std::stod(read_bytes(dir + "/loss.txt"));
  auto [rcv, verify] = run_command(std::string(TESSERA_CLI) + " ckpt verify " + dir + "/tessera");
  ASSERT_EQ(rcv, 0) << verify;
  auto [rcg, run] = run_command(kNoLauncherEnv + gpt + " train --strategy fsdp --devices 2 --init-from " + dir +
                                "/tessera --max-steps 1 --n-layer 2 --n-head 2 --d-model 32 --seq-len 17 " +
                                "--batch-size 8 --log-every 1 --val-every 0 --threads 1 --no-progress-bar --data " +
                                text + " --out " + dir + "/run");
  ASSERT_EQ(rcg, 0) << run;
  EXPECT_NE(run.find("initial weights from"), std::string::npos) << run;
  // metrics.csv: step,epoch,lr,train_loss,...; the row of step 1.
  const std::string csv = read_bytes(dir + "/run/metrics.csv");
  const size_t row = csv.find("\n1,");
  ASSERT_NE(row, std::string::npos) << csv;
  size_t at = row + 1;
  for (int comma = 0; comma < 3; ++comma) at = csv.find(',', at) + 1;
  const double got = std::stod(csv.substr(at));
  EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "gpt's first loss " << got << ", Python's " << want
                                                          << "\n" << csv;
}

#endif  // TESSERA_PYTHON_HAS_DCP
