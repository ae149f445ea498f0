// `gpt train --init-from PATH` (examples/gpt): a new run, at step 0 with a fresh
// optimizer, from the model weights of a checkpoint of any kind Tessera reads.
//
// The check that the weights really arrive: the training text repeats one 16-byte
// pattern and the windows are 16 bytes apart, so every training window is the same and
// every batch has the same loss under given weights, whatever the data order, batch
// split or world size. A run initialized from the weights a source run had after step 4
// must then report, as its first loss, the source run's loss at step 5 (a run that kept
// its own initial weights reports about the source's step-1 loss, far from it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "examples/gpt_test_util.h"
#include "support/test_util.h"

namespace fs = std::filesystem;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;

namespace {

using tessera::testing::gpt::kCli;
using tessera::testing::kNoLauncherEnv;
using tessera::testing::gpt::kGpt;
using tessera::testing::gpt::train_losses;
const std::string kPython = TESSERA_PYTHON;
const std::string kScript = std::string(TESSERA_SOURCE_DIR) + "/tests/python/gpt_init_from_files.py";
const std::string kShape = " --n-layer 2 --n-head 2 --d-model 32 --seq-len 16";
const std::string kRest = " --batch-size 8 --lr 3e-3 --seed 5 --log-every 1 --val-every 4 --threads 1 --no-progress-bar";
const std::string kTiny = kShape + kRest;

// 16 bytes (= --seq-len): every window of 17 bytes at a stride of 16 is the same.
std::string periodic_text() {
  std::string s;
  for (int i = 0; i < 800; ++i) s += "shard tensor ok\n";
  return s;
}

}  // namespace

class GptInitFrom : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  }
};

TEST_F(GptInitFrom, FirstLossIsTheSourceRunsLossOfThoseWeights) {
  const std::string dir = temp_dir("tessera-gpt-init");
  const std::string data = dir + "/text.txt";
  write_bytes(data, periodic_text());
  const std::string common = " --data " + data + kTiny;

  // The source: FSDP on 2 ranks, 8 steps; and the same run stopped at step 4 (same
  // schedule), whose sharded last.ckpt holds the weights the 8-step run had after step 4.
  auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --strategy fsdp --devices 2 --max-steps 8 --out " + dir + "/src" +
                                 common);
  ASSERT_EQ(rc1, 0) << out1;
  auto [rc2, out2] = run_command(kNoLauncherEnv + kGpt + " train --strategy fsdp --devices 2 --max-steps 4 --lr-decay-steps 8 " +
                                 "--out " + dir + "/src4" + common);
  ASSERT_EQ(rc2, 0) << out2;
  const std::string sharded = dir + "/src4/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::is_directory(sharded));
  const auto src = train_losses(dir + "/src/metrics.csv");
  ASSERT_EQ(src.size(), 8u) << read_bytes(dir + "/src/metrics.csv");
  const double want = src.at(5);
  // The check can fail: the initial weights' loss is far from the step-5 loss.
  ASSERT_GT(src.at(1) - want, 0.1) << "step 1 " << src.at(1) << ", step 5 " << want;

  // The other kinds of checkpoint: consolidated (tessera ckpt consolidate), and the bare
  // state dict (keys <fqn>) written by Python's torch.save and safetensors, and as a Hugging
  // Face model directory by huggingface_hub (several shards and the index).
  const std::string cons = dir + "/src4.safetensors";
  auto [rc3, out3] = run_command(kCli + " ckpt consolidate " + sharded + " -o " + cons);
  ASSERT_EQ(rc3, 0) << out3;
  auto [rc4, out4] = run_command(kPython + " " + kScript + " " + cons + " " + dir);
  ASSERT_EQ(rc4, 0) << out4;

  struct Case {
    std::string name, launch, from;
  };
  const std::vector<Case> cases = {
      {"single-sharded", kGpt + " train --strategy single", sharded},
      {"ddp2-consolidated", kGpt + " train --strategy ddp --devices 2", cons},
      {"fsdp4-torch", kCli + " run -n 4 -- " + kGpt + " train --strategy fsdp", dir + "/bare.pt"},
      {"fsdp2-gradop-safetensors", kGpt + " train --strategy fsdp --sharding grad-op --devices 2",
       dir + "/bare.safetensors"},
      {"fsdp2-hf-dir", kGpt + " train --strategy fsdp --devices 2", dir + "/hf"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string out_dir = dir + "/" + c.name;
    auto [rc, out] = run_command(kNoLauncherEnv + c.launch + " --max-steps 2 --init-from " + c.from + " --out " + out_dir + common);
    ASSERT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("initial weights from '" + c.from + "'"), std::string::npos) << out;
    EXPECT_NE(out.find("done step=2 steps_this_run=2"), std::string::npos) << out;  // from step 0
    const auto got = train_losses(out_dir + "/metrics.csv");
    ASSERT_EQ(got.size(), 2u) << read_bytes(out_dir + "/metrics.csv");
    // Forward of the same weights on the same rows: only the reduction order differs
    // (batch split over 1, 2 or 4 ranks).
    EXPECT_LE(std::abs(got.at(1) - want), 1e-5 * std::abs(want)) << "first loss " << got.at(1) << ", source step 5 "
                                                                  << want;
  }
}

TEST_F(GptInitFrom, BadCheckpointsAreRefusedNamingTheKeyAndTheFile) {
  const std::string dir = temp_dir("tessera-gpt-init");
  const std::string data = dir + "/text.txt";
  write_bytes(data, periodic_text());
  const std::string common = " --data " + data + kTiny;
  auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --strategy single --max-steps 1 --out " + dir + "/src" + common);
  ASSERT_EQ(rc1, 0) << out1;
  const std::string ckpt = dir + "/src/checkpoints/last.ckpt";  // consolidated (single)
  auto [rc2, out2] = run_command(kPython + " " + kScript + " " + ckpt + " " + dir);
  ASSERT_EQ(rc2, 0) << out2;

  struct Case {
    std::string flags;
    std::vector<std::string> named;
    std::string shape = kShape;
  };
  const std::vector<Case> cases = {
      {"--init-from " + ckpt + " --resume last", {"--init-from", "--resume"}},
      {"--init-from " + dir + "/nothing", {"--init-from", dir + "/nothing"}},
      // Another model shape: the key, both shapes, the file, the checkpoint's hparams.
      {"--init-from " + ckpt,
       {ckpt, "model.blocks.0.fc.bias is [128], not [256]", "the checkpoint's hparams: n_layer 2"},
       " --n-layer 2 --n-head 2 --d-model 64 --seq-len 16"},
      {"--init-from " + dir + "/missing.safetensors", {dir + "/missing.safetensors", "head.weight [256, 32] is missing"}},
      {"--init-from " + dir + "/extra.safetensors",
       {dir + "/extra.safetensors", "blocks.9.fc.weight [4, 4] is not a weight of this model"}},
      {"--init-from " + dir + "/bf16.safetensors", {dir + "/bf16.safetensors", "ln_f.weight is BF16, not F32"}},
      {"--init-from " + dir + "/bare.pt --tie-weights", {dir + "/bare.pt", "head.weight [256, 32] is not a weight"}},
      // A Hugging Face directory whose index names a tensor its shard does not hold.
      {"--init-from " + dir + "/hf-missing",
       {dir + "/hf-missing/model.safetensors.index.json': tensor 'head.weight' is mapped to 'model-", "does not hold it"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.flags);
    const std::string out_dir = dir + "/bad";
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + " train --strategy single --max-steps 2 " + c.flags + " --out " + out_dir +
                                 " --data " + data + c.shape + kRest);
    EXPECT_NE(rc, 0) << out;
    for (const auto& n : c.named) EXPECT_NE(out.find(n), std::string::npos) << "does not name '" << n << "':\n" << out;
    EXPECT_FALSE(fs::exists(out_dir + "/checkpoints")) << "a refused run wrote a checkpoint";
  }
}
