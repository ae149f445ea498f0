// tessera_ckpt.dcp (issue 36 item 1): PyTorch 2.x's own dcp.save / dcp.load through
// Tessera's StorageWriter / StorageReader, at 1, 2 and 3 ranks on Gloo, both ways, with
// FSDP2 (fully_shard) models and AdamW state bit-exact, the v1 fixture and v2 layouts read
// into DTensors, and every written checkpoint accepted by `tessera ckpt verify`
// (tests/python/dcp_backend_check.py). Compiled only where the tests' Python has
// torch.distributed.checkpoint (the torch 2.x build, make test-torch2).
#include <gtest/gtest.h>

#include "support/build_paths.h"
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

namespace {

// metrics.csv's train_loss (step,epoch,lr,train_loss,...) of `step`.
double csv_loss(const std::string& csv, int step) {
  const size_t row = csv.find("\n" + std::to_string(step) + ",");
  if (row == std::string::npos) return std::nan("");
  size_t at = row + 1;
  for (int comma = 0; comma < 3; ++comma) at = csv.find(',', at) + 1;
  return std::stod(csv.substr(at));
}

// The number after "\"KEY\": " in the peer's one-line JSON.
double json_number(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return std::nan("");
  return std::stod(json.substr(at + key.size() + 4));
}

// DIR/text.txt: one 17-byte pattern (= --seq-len) repeated, so every training window of gpt
// is the same window and the data order does not matter. Returns its path.
std::string repeated_window_text(const std::string& dir) {
  std::string pattern;
  for (int i = 0; i < 800; ++i) pattern += "shard tensor ok!\n";
  write_bytes(dir + "/text.txt", pattern);
  return dir + "/text.txt";
}

}  // namespace

// The GPT of examples/gpt in PyTorch (tests/python/gpt_dcp_peer.py: the same architecture
// and parameter names, random weights), sharded by FSDP2 over 2 ranks and saved with
// dcp.save through tessera_ckpt.dcp.Writer, is a Tessera checkpoint as it is: `tessera ckpt
// verify` accepts it, and `gpt train --init-from` on it (FSDP, 2 ranks, no import step) starts
// with the loss Python computed with those weights on the same window.
TEST(DcpBackend, GptStartsFromAnFsdp2ModelSavedThroughTheWriter) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!std::filesystem::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-dcp-writer-gpt");
  const std::string text = repeated_window_text(dir);
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
  const std::string csv = read_bytes(dir + "/run/metrics.csv");
  const double got = csv_loss(csv, 1);
  EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "gpt's first loss " << got << ", Python's " << want
                                                          << "\n" << csv;
}


// Both ways with the optimizer (tests/python/gpt_trainer_state_peer.py): the GPT trained by
// FSDP2 + torch.optim.AdamW on 2 ranks for 3 steps, saved by tessera_ckpt.dcp.TrainerState
// (through the Writer), is resumed by `gpt train --resume` (FSDP, 2 ranks; the Trainer says
// it has no loop state) with the losses Python computed for steps 4 and 5; gpt's own
// checkpoint at step 5 is then loaded by TrainerState.load into an FSDP2 model on 3 ranks
// (through the Reader: weights and AdamW state bit-exact against tessera_ckpt's reader, the
// state the one Python reached after the same steps), whose steps 6 and 7 are the losses
// `gpt train --resume last` logs.
TEST(DcpBackend, GptAndFsdp2ResumeEachOthersTrainingWithTheOptimizerState) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!std::filesystem::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-dcp-trainer-state");
  const std::string text = repeated_window_text(dir);
  const std::string peer = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                           "/tests/python/gpt_trainer_state_peer.py ";
  const std::string shape = " 2 2 32 17 0.002 2 20 ";  // n_layer n_head d_model seq_len lr warmup decay
  const std::string flags = " train --strategy fsdp --devices 2 --batch-size 8 --lr 0.002 --warmup-steps 2 "
                            "--lr-decay-steps 20 --grad-clip 0 --log-every 1 --val-every 0 --limit-val-batches 0 "
                            "--threads 1 --no-progress-bar --data " + text + " --out " + dir + "/run";
  auto [rc, out] = run_command(kNoLauncherEnv + std::string(TESSERA_CLI) + " run -n 2 -- " + peer + "save " + text +
                               " " + dir + shape + "3");
  ASSERT_EQ(rc, 0) << out;
  auto [rcv, verify] = run_command(std::string(TESSERA_CLI) + " ckpt verify " + dir + "/ckpt");
  ASSERT_EQ(rcv, 0) << verify;

  auto [rcg, run] = run_command(kNoLauncherEnv + gpt + flags + " --resume " + dir + "/ckpt --max-steps 5");
  ASSERT_EQ(rcg, 0) << run;
  EXPECT_NE(run.find("has no Trainer loop state"), std::string::npos) << run;
  EXPECT_NE(run.find("resuming at step 3 (epoch 0, batch 3 of"), std::string::npos) << run;
  const std::string saved = read_bytes(dir + "/save.json");
  std::string csv = read_bytes(dir + "/run/metrics.csv");
  for (int step : {4, 5}) {
    const double want = json_number(saved, std::to_string(step)), got = csv_loss(csv, step);
    EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "step " << step << ": gpt " << got << ", Python " << want
                                                            << "\n" << csv;
  }
  EXPECT_EQ(csv.find("\n3,"), std::string::npos) << "gpt re-ran a step before the checkpoint\n" << csv;

  auto [rcl, loaded] = run_command(kNoLauncherEnv + std::string(TESSERA_CLI) + " run -n 3 -- " + peer + "load " + text +
                                   " " + dir + shape + dir + "/run/checkpoints/last.ckpt");
  ASSERT_EQ(rcl, 0) << loaded;
  const std::string load = read_bytes(dir + "/load.json");
  EXPECT_GE(json_number(load, "checked"), 17 * 3) << load;  // 17 weights, each with exp_avg and exp_avg_sq
  auto [rcg2, run2] = run_command(kNoLauncherEnv + gpt + flags + " --resume last --max-steps 7");
  ASSERT_EQ(rcg2, 0) << run2;
  EXPECT_EQ(run2.find("has no Trainer loop state"), std::string::npos) << run2;  // gpt's own checkpoint
  csv = read_bytes(dir + "/run/metrics.csv");
  for (int step : {6, 7}) {
    const double want = json_number(load, std::to_string(step)), got = csv_loss(csv, step);
    EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "step " << step << ": gpt " << got << ", Python " << want
                                                            << "\n" << csv;
  }
}

// Issue 47 item 4, 2-D checkpoints both ways with PyTorch (tests/python/dcp_2d_check.py): gpt's
// sharded FSDP x TP checkpoint (--tp 2 on 4 ranks: tp layouts, qkv in 3 stripes, interleaved
// replica groups) loaded by dcp.load through tessera_ckpt.dcp.Reader into torch FSDP2 + TP models
// (DTensors with _StridedShard placements) at (dp, tp) 2x2, 1x4, 4x1 and 1x3 (uneven pieces), and
// by TrainerState with AdamW; FSDP2 + TP state dicts saved through the Writer accepted by `tessera
// ckpt verify`, equal after `consolidate`, started from by `gpt train --init-from` at --tp 2 and
// on one process, resumed by `gpt train --resume` (TrainerState); `tessera ckpt import-dcp` of the
// same state dict saved by DCP's FileSystemWriter; a DTensor with Tessera's own stripe cut
// (_StridedShard(0, split_factor=3)), which DCP describes wrongly, refused by the Reader.
TEST(DcpBackend, TwoDimensionalCheckpointsCrossWithFsdp2AndTensorParallelModels) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!std::filesystem::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-dcp-2d");
  const std::string text = repeated_window_text(dir);
  auto [rcg, run] = run_command(kNoLauncherEnv + gpt + " train --strategy fsdp --devices 4 --tp 2 --n-layer 2 " +
                                "--n-head 4 --d-model 32 --seq-len 16 --batch-size 4 --max-steps 4 --ckpt-every 2 " +
                                "--log-every 1 --val-every 0 --threads 1 --no-progress-bar --data " + text +
                                " --out " + dir + "/run");
  ASSERT_EQ(rcg, 0) << run;
  auto [rc, out] = run_command(kNoLauncherEnv + std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                               "/tests/python/dcp_2d_check.py " + dir + "/run/checkpoints/last.ckpt --tessera " +
                               TESSERA_CLI + " --gpt " + gpt + " --work " + dir + "/work");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok dcp_2d_check:"), std::string::npos) << out;
}

#endif  // TESSERA_PYTHON_HAS_DCP
