// The GPT example end to end (examples/gpt, the `gpt` binary in build/bin), on a tiny
// config and a small generated text so each run takes seconds:
//  - parity: one process (`--strategy single`) and 2 ranks with FSDP started by
//    `tessera run -n 2` write the same losses to metrics.csv (fp32 reduction-order noise);
//  - sampling from the sharded checkpoint and from its `tessera ckpt consolidate` output
//    prints the same text for the same seed;
//  - resume from the last checkpoint continues the uninterrupted run's losses;
//  - bad flags fail with a message naming the flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
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
using tessera::testing::gpt::read_metrics;
// Tiny model and data; validation every 4 steps, a metrics row every step.
const std::string kTiny =
    " --n-layer 2 --n-head 2 --d-model 32 --seq-len 16 --batch-size 8 --lr 3e-3 --seed 5 --log-every 1 --val-every 4 "
    "--threads 1 --no-progress-bar";

// Parameters of the tiny model, untied: embeddings 256*32 + 16*32, 2 blocks of
// 12,704 (LayerNorms 128, qkv 3,168, proj 1,056, fc 4,224, fc_out 4,128), ln_f 64, head 256*32.
constexpr int64_t kTinyUntiedParams = 256 * 32 + 16 * 32 + 2 * 12704 + 64 + 256 * 32;

// ~12 KB of text with some structure to learn.
std::string make_text() {
  std::ostringstream s;
  const char* words[] = {"shard", "tensor", "rank", "gather", "scatter", "reduce", "checkpoint", "module"};
  for (int i = 0; i < 1500; ++i) s << words[(i * 7 + i / 3) % 8] << ((i % 11 == 10) ? ".\n" : " ");
  return s.str();
}

struct GptRun {
  std::string dir, data;
  GptRun() : dir(temp_dir("tessera-gpt")) {
    data = dir + "/text.txt";
    write_bytes(data, make_text());
  }
};

void expect_close(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, double rel_tol,
                  const std::string& what, int64_t from_step = 0) {
  size_t compared = 0;
  for (const auto& [step, w] : want) {
    if (step < from_step) continue;
    auto it = got.find(step);
    ASSERT_NE(it, got.end()) << what << ": no value at step " << step;
    EXPECT_LE(std::abs(it->second - w), rel_tol * std::abs(w)) << what << " at step " << step << ": " << it->second
                                                               << " vs " << w;
    ++compared;
  }
  EXPECT_GT(compared, 0u) << what << ": nothing to compare";
}

}  // namespace

class Gpt : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  }
};

// Tolerance: the 2-rank FSDP run averages per-rank means and reduce-scatters gradients, so
// sums happen in another order than in one process. Observed differences are below 1e-6
// relative for train_loss and 1e-5 for val_loss over these steps; 1e-4 leaves room for
// other BLAS builds while still catching any real divergence (a wrong shard, a missed
// gradient or a different batch changes the loss in the 2nd-3rd digit).
TEST_F(Gpt, SingleAndFsdpTwoRanksWriteTheSameLosses) {
  GptRun r;
  auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --strategy single --max-steps 8 --data " + r.data + " --out " +
                                 r.dir + "/single" + kTiny);
  ASSERT_EQ(rc1, 0) << out1;
  auto [rc2, out2] = run_command(kNoLauncherEnv + kCli + " run -n 2 -- " + kGpt + " train --strategy fsdp --max-steps 8 --data " +
                                 r.data + " --out " + r.dir + "/fsdp" + kTiny);
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("strategy fsdp on 2 rank(s)"), std::string::npos) << out2;
  auto single = read_metrics(r.dir + "/single/metrics.csv");
  auto fsdp = read_metrics(r.dir + "/fsdp/metrics.csv");
  ASSERT_EQ(single["train_loss"].size(), 8u) << read_bytes(r.dir + "/single/metrics.csv");
  expect_close(fsdp["train_loss"], single["train_loss"], 1e-4, "train_loss fsdp vs single");
  expect_close(fsdp["val_loss"], single["val_loss"], 1e-4, "val_loss fsdp vs single");
  expect_close(fsdp["lr"], single["lr"], 1e-9, "lr fsdp vs single");
  // The loss falls (the model learns the word sequence).
  EXPECT_LT(single["train_loss"].at(8), single["train_loss"].at(1) - 0.5);
  // Sharded checkpoint by default for FSDP: a directory; a consolidated file for single.
  EXPECT_TRUE(fs::is_directory(r.dir + "/fsdp/checkpoints/last.ckpt"));
  EXPECT_TRUE(fs::is_regular_file(r.dir + "/single/checkpoints/last.ckpt"));

  // Sampling: sharded directory vs its consolidated file vs the single run's file.
  const std::string cons = r.dir + "/fsdp/consolidated.safetensors";
  auto [rc3, out3] = run_command(kCli + " ckpt consolidate " + r.dir + "/fsdp/checkpoints/last.ckpt -o " + cons);
  ASSERT_EQ(rc3, 0) << out3;
  const std::string sample = " --prompt 'shard tensor' --tokens 40 --temperature 0.9 --top-k 20 --seed 11";
  auto [rc4, sharded_text] = run_command(kGpt + " sample --ckpt " + r.dir + "/fsdp/checkpoints/last.ckpt" + sample);
  ASSERT_EQ(rc4, 0) << sharded_text;
  auto [rc5, cons_text] = run_command(kGpt + " sample --ckpt " + cons + sample);
  ASSERT_EQ(rc5, 0) << cons_text;
  EXPECT_EQ(sharded_text, cons_text);
  EXPECT_EQ(sharded_text.rfind("shard tensor", 0), 0u) << sharded_text;
  EXPECT_GE(sharded_text.size(), std::string("shard tensor").size() + 40);
  auto [rc6, other_seed] = run_command(kGpt + " sample --ckpt " + cons +
                                       " --prompt 'shard tensor' --tokens 40 --temperature 0.9 --top-k 20 --seed 12");
  ASSERT_EQ(rc6, 0) << other_seed;
  EXPECT_NE(other_seed, cons_text) << "the seed does not change the sample";
}

// Tied head: the token embedding's weight is used twice inside FSDP's root unit (one
// registered tensor, so no shared-parameter refusal); both uses' gradients must arrive.
TEST_F(Gpt, TiedHeadUnderFsdpMatchesOneProcess) {
  GptRun r;
  const std::string tiny = " --max-steps 4 --tie-weights --data " + r.data + kTiny;
  auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --strategy single --out " + r.dir + "/single" + tiny);
  ASSERT_EQ(rc1, 0) << out1;
  auto [rc2, out2] = run_command(kNoLauncherEnv + kGpt + " train --strategy fsdp --devices 2 --out " + r.dir + "/fsdp" + tiny);
  ASSERT_EQ(rc2, 0) << out2;
  auto single = read_metrics(r.dir + "/single/metrics.csv");
  auto fsdp = read_metrics(r.dir + "/fsdp/metrics.csv");
  ASSERT_EQ(single["train_loss"].size(), 4u);
  expect_close(fsdp["train_loss"], single["train_loss"], 1e-4, "tied train_loss fsdp vs single");
  // One weight fewer than untied: 256 x 32 head weights are not there.
  EXPECT_NE(out1.find("params=" + std::to_string(kTinyUntiedParams - 256 * 32)), std::string::npos) << out1;
  // The two ranks' gathers and reduce-scatters went through shared memory, and gpt reports
  // them for its timed steps (one rank has no such line).
  const std::string shm = "gpt: shared-memory collectives=";
  EXPECT_EQ(out1.find(shm), std::string::npos) << out1;
  const auto at = out2.find(shm);
  ASSERT_NE(at, std::string::npos) << out2;
  EXPECT_GT(std::stoll(out2.substr(at + shm.size())), 0) << out2;
}

// A run stopped at step 6 (same LR schedule: --lr-decay-steps 10) and resumed to 10
// continues the uninterrupted run's losses; `flags` choose how it checkpoints.
// The runs write to r.dir/NAME-full and r.dir/NAME-part.
static void expect_resume_continues(const GptRun& r, const std::string& name, const std::string& flags) {
  SCOPED_TRACE(flags);
  const std::string common = " --strategy fsdp --devices 2 --data " + r.data + flags + kTiny;
  const std::string full_dir = r.dir + "/" + name + "-full", part_dir = r.dir + "/" + name + "-part";
  auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --max-steps 10 --out " + full_dir + common);
  ASSERT_EQ(rc1, 0) << out1;
  auto [rc2, out2] = run_command(kNoLauncherEnv + kGpt + " train --max-steps 6 --lr-decay-steps 10 --ckpt-every 3 --out " +
                                 part_dir + common);
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("gpt: checkpoints saves="), std::string::npos) << out2;
  {  // Both ranks' generator states: one [2, bytes] uint8 tensor, not a value per rank.
    const auto meta = tessera::checkpoint::open_checkpoint(part_dir + "/checkpoints/last.ckpt");
    auto it = meta.entries.find("rng.cpu");
    ASSERT_NE(it, meta.entries.end());
    EXPECT_TRUE(it->second.is_tensor());
    EXPECT_EQ(it->second.dtype, at::kByte);
    ASSERT_EQ(it->second.shape.size(), 2u);
    EXPECT_EQ(it->second.shape[0], 2);
    EXPECT_EQ(meta.entries.count("rng.cpu_0"), 0u);
  }
  auto [rc3, out3] = run_command(kNoLauncherEnv + kGpt + " train --max-steps 10 --resume last --out " + part_dir + common);
  ASSERT_EQ(rc3, 0) << out3;
  EXPECT_NE(out3.find("steps_this_run=4"), std::string::npos) << out3;
  auto full = read_metrics(full_dir + "/metrics.csv");
  auto part = read_metrics(part_dir + "/metrics.csv");
  // metrics.csv keeps the first run's rows and continues them.
  EXPECT_EQ(part["train_loss"].size(), 10u) << read_bytes(part_dir + "/metrics.csv");
  expect_close(part["train_loss"], full["train_loss"], 1e-5, "resumed train_loss");
  expect_close(part["lr"], full["lr"], 1e-9, "resumed lr");
}

// Every tensor of a checkpoint, read whole on one process.
static tessera::state::StateDict read_tensors(const std::string& path) {
  const auto m = tessera::checkpoint::open_checkpoint(path);
  tessera::state::StateDict t;
  for (const auto& k : m.keys)
    if (m.entries.at(k).is_tensor()) t.set(k, at::empty(m.entries.at(k).shape, at::TensorOptions().dtype(m.entries.at(k).dtype)));
  tessera::checkpoint::LoadOptions lax;
  lax.strict = false;  // the plain values (step, hparams) are not asked for
  tessera::checkpoint::load_local(t, path, lax);
  return t;
}

// FSDP 2 x TP 2 (sequence parallel) on four ranks, and pure TP on two without sequence
// parallelism and with a tied head, against one process: the same losses (within 1e-4, as
// FSDP alone above), and FSDP's default checkpoint, sharded in 2-D (format version 3: qkv's
// weight one tp rule of 3 stripes over tp 2, cut by FSDP's flat rule over dp 2), under the
// plain model's names and shapes, which `gpt sample` reads on one process.
TEST_F(Gpt, TensorParallelRunsMatchOneProcess) {
  GptRun r;
  for (const std::string tied : {"", " --tie-weights"}) {
    SCOPED_TRACE(tied);
    const std::string tiny = " --max-steps 6 --data " + r.data + tied + kTiny;
    const std::string tag = tied.empty() ? "untied" : "tied";
    auto [rc1, out1] = run_command(kNoLauncherEnv + kGpt + " train --strategy single --out " + r.dir + "/single-" + tag + tiny);
    ASSERT_EQ(rc1, 0) << out1;
    auto [rc2, out2] = run_command(kNoLauncherEnv + kGpt + " train --strategy fsdp --devices 4 --tp 2 --out " + r.dir +
                                   "/tp2x2-" + tag + tiny);
    ASSERT_EQ(rc2, 0) << out2;
    EXPECT_NE(out2.find("on 4 rank(s) (dp 2 x tp 2, sequence parallel)"), std::string::npos) << out2;
    auto [rc3, out3] = run_command(kNoLauncherEnv + kGpt + " train --strategy ddp --devices 2 --tp 2 " +
                                   "--no-sequence-parallel --out " + r.dir + "/tp2-" + tag + tiny);
    ASSERT_EQ(rc3, 0) << out3;
    EXPECT_NE(out3.find("(dp 1 x tp 2)"), std::string::npos) << out3;
    auto single = read_metrics(r.dir + "/single-" + tag + "/metrics.csv");
    ASSERT_EQ(single["train_loss"].size(), 6u);
    for (const std::string run : {"tp2x2-", "tp2-"}) {
      auto got = read_metrics(r.dir + "/" + run + tag + "/metrics.csv");
      expect_close(got["train_loss"], single["train_loss"], 1e-4, run + tag + " train_loss vs single");
      expect_close(got["val_loss"], single["val_loss"], 1e-4, run + tag + " val_loss vs single");
    }
    const std::string ckpt = r.dir + "/tp2x2-" + tag + "/checkpoints/last.ckpt";
    ASSERT_TRUE(fs::is_directory(ckpt));
    const auto meta = tessera::checkpoint::open_checkpoint(ckpt);
    EXPECT_EQ(meta.version, 3);
    ASSERT_EQ(meta.entries.count("model.blocks.0.qkv.weight"), 1u);
    const auto& qkv = meta.entries.at("model.blocks.0.qkv.weight");
    EXPECT_EQ(qkv.shape, (std::vector<int64_t>{96, 32}));
    ASSERT_TRUE(qkv.layout.has_value());
    EXPECT_EQ(qkv.layout->rule_name(), "tp");
    EXPECT_EQ(qkv.layout->stripes, 3);
    EXPECT_EQ(qkv.layout->tp, 2);
    EXPECT_EQ(qkv.layout->inner, tessera::sharding::Layout::Rule::Flat);
    EXPECT_EQ(qkv.layout->pieces, 2);
    // The 2-D checkpoint's tensors, read whole, equal bit for bit those of its offline
    // reshards to 1-D layouts (3 ranks, one file) and of a consolidation.
    const tessera::state::StateDict want = read_tensors(ckpt);
    for (const std::string& cmd : {"reshard " + ckpt + " --world-size 3 -o " + r.dir + "/r3-" + tag,
                                   "reshard " + ckpt + " --world-size 1 -o " + r.dir + "/r1-" + tag,
                                   "consolidate " + ckpt + " -o " + r.dir + "/c-" + tag + ".safetensors"}) {
      auto [rc, out] = run_command(kCli + " ckpt " + cmd);
      ASSERT_EQ(rc, 0) << cmd << "\n" << out;
      const std::string to = cmd.substr(cmd.rfind(' ') + 1);
      const tessera::state::StateDict got = read_tensors(to);
      ASSERT_EQ(got.keys(), want.keys()) << to;
      for (const auto& k : want.keys()) EXPECT_TRUE(got.tensor(k).equal(want.tensor(k))) << to << " key " << k;
    }
    const std::string sample = " --prompt 'shard' --tokens 12 --seed 3";
    auto [rc4, text] = run_command(kGpt + " sample --ckpt " + ckpt + sample);
    ASSERT_EQ(rc4, 0) << text;
    EXPECT_EQ(text.rfind("shard", 0), 0u) << text;
  }
}

// `tessera ckpt reshard --world-size N --tp T` of a (dp 2, tp 2) checkpoint writes what a
// job on that mesh saves: every key's kind and rule (files included) equal to those of the
// checkpoint a run at that mesh wrote. Resuming from the reshard continues exactly as
// resuming the original at that mesh: the same losses and, at the end, the same tensors bit
// for bit. Meshes: (dp 1, tp 2), where FSDP keeps the replicated parameters whole; (dp 4, tp
// 2), where an FSDP piece misses some of qkv's stripes (its sharded save once read past its
// rows); and FSDP alone over 4 and over 2 ranks (the units' flat sizes recomputed from the TP
// pieces').
TEST_F(Gpt, OfflineReshardToAnotherMeshResumesLikeTheOriginal) {
  GptRun r;
  const std::string common = " --strategy fsdp --data " + r.data + kTiny;
  const std::string src_dir = r.dir + "/src";
  auto [rc0, out0] = run_command(kNoLauncherEnv + kGpt + " train --devices 4 --tp 2 --max-steps 3 --lr-decay-steps 6 " +
                                 "--ckpt-every 3 --out " + src_dir + common);
  ASSERT_EQ(rc0, 0) << out0;
  const std::string src = src_dir + "/checkpoints/last.ckpt";
  ASSERT_EQ(tessera::checkpoint::open_checkpoint(src).version, 3);
  struct Mesh {
    int devices, tp;
  };
  for (const Mesh mesh : {Mesh{2, 2}, Mesh{8, 2}, Mesh{4, 1}, Mesh{2, 1}}) {
    const std::string tag = std::to_string(mesh.devices) + "x" + std::to_string(mesh.tp);
    SCOPED_TRACE(tag);
    const std::string resharded = r.dir + "/reshard-" + tag;
    auto [rc, out] = run_command(kCli + " ckpt reshard " + src + " --world-size " + std::to_string(mesh.devices) +
                                 " --tp " + std::to_string(mesh.tp) + " -o " + resharded);
    ASSERT_EQ(rc, 0) << out;
    const std::string at_mesh = " train --devices " + std::to_string(mesh.devices) + " --tp " + std::to_string(mesh.tp) +
                                " --max-steps 6 --lr-decay-steps 6 --ckpt-every 3" + common;
    std::map<std::string, decltype(read_metrics(""))> metrics;
    for (const std::string& from : {src, resharded}) {
      const std::string out_dir = r.dir + (from == src ? "/orig-" : "/resh-") + tag;
      auto [rc2, out2] = run_command(kNoLauncherEnv + kGpt + at_mesh + " --resume " + from + " --out " + out_dir);
      ASSERT_EQ(rc2, 0) << out2;
      EXPECT_NE(out2.find("steps_this_run=3"), std::string::npos) << out2;
      metrics[from] = read_metrics(out_dir + "/metrics.csv");
    }
    ASSERT_EQ(metrics[src]["train_loss"].size(), 3u);
    EXPECT_EQ(metrics[resharded]["train_loss"], metrics[src]["train_loss"]);
    const std::string a = r.dir + "/orig-" + tag + "/checkpoints/last.ckpt", b = r.dir + "/resh-" + tag + "/checkpoints/last.ckpt";
    const tessera::state::StateDict ta = read_tensors(a), tb = read_tensors(b);
    ASSERT_EQ(ta.keys(), tb.keys());
    for (const auto& k : ta.keys()) EXPECT_TRUE(ta.tensor(k).equal(tb.tensor(k))) << "key " << k;
    // The reshard's rules are the ones the job at that mesh saved with.
    const auto saved = tessera::checkpoint::open_checkpoint(a), planned = tessera::checkpoint::open_checkpoint(resharded);
    EXPECT_EQ(planned.world_size, mesh.devices);
    EXPECT_EQ(planned.version, saved.version);
    ASSERT_EQ(planned.keys, saved.keys);
    int differing = 0;
    for (const auto& k : saved.keys) {
      const auto& x = saved.entries.at(k);
      const auto& y = planned.entries.at(k);
      if (!x.is_tensor()) continue;
      const bool same = x.kind == y.kind && x.layout.has_value() == y.layout.has_value() && (!x.layout || *x.layout == *y.layout);
      if (!same && ++differing <= 5)
        ADD_FAILURE() << "key " << k << ": saved " << x.kind << " " << (x.layout ? x.layout->rule_name() : "-")
                      << ", resharded " << y.kind << " " << (y.layout ? y.layout->rule_name() : "-");
    }
    EXPECT_EQ(differing, 0);
  }
}

// FSDP 2 x TP 2 saved sharded: a format-3 checkpoint (tp layouts, interleaved replica groups)
// that the Python package verifies and loads, every tensor equal to the full checkpoint of
// the same run (tests/python/tessera_ckpt_2d_check.py; issue 47).
TEST_F(Gpt, PythonPackageReadsATwoDimensionalShardedCheckpoint) {
  GptRun r;
  const std::string tiny = " --max-steps 2 --ckpt-every 2 --data " + r.data + kTiny;
  for (const std::string kind : {"sharded", "full"}) {
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + " train --strategy fsdp --devices 4 --tp 2 --state-dict " +
                                 kind + " --out " + r.dir + "/" + kind + tiny);
    ASSERT_EQ(rc, 0) << out;
  }
  const std::string ckpt = r.dir + "/sharded/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::is_directory(ckpt));
  EXPECT_EQ(tessera::checkpoint::open_checkpoint(ckpt).version, 3);
  auto [rc, out] = run_command(tessera::testing::py("tessera_ckpt_2d_check.py " + ckpt + " " + r.dir +
                                                    "/full/checkpoints/last.ckpt"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok tessera_ckpt_2d_check:"), std::string::npos) << out;
}

TEST_F(Gpt, ResumeFromLastCheckpointContinuesTheRun) {
  GptRun r;
  expect_resume_continues(r, "sync", "");
}

// Pure tensor parallelism (FSDP over one data-parallel rank, TP 2, sequence parallel):
// the checkpoint is sharded in 2-D (each tp rank's pieces, whole over dp) and the resumed
// run continues exactly; so does one saved full (the plain model's tensors).
TEST_F(Gpt, ResumeUnderTensorParallelismContinuesTheRun) {
  GptRun r;
  expect_resume_continues(r, "tp", " --tp 2");
  EXPECT_TRUE(fs::is_directory(r.dir + "/tp-part/checkpoints/last.ckpt"));
  expect_resume_continues(r, "tpfull", " --tp 2 --state-dict full");
  EXPECT_TRUE(fs::is_regular_file(r.dir + "/tpfull-part/checkpoints/last.ckpt"));
  // Written in the background: the snapshot keeps each parameter's pieces, one per stripe.
  expect_resume_continues(r, "tpasync", " --tp 2 --async-ckpt");
  EXPECT_TRUE(fs::is_directory(r.dir + "/tpasync-part/checkpoints/last.ckpt"));
}

// --sharding hybrid with --tp: FSDP's HYBRID_SHARD over the data-parallel ranks of a (dp,
// tp) mesh (the node's dp ranks one shard group), checkpoints consolidated by default (a
// (replicate, shard, tp) state has no sharded form yet), and the resumed run continues.
TEST_F(Gpt, HybridShardingUnderTensorParallelismResumes) {
  GptRun r;
  expect_resume_continues(r, "tphsdp", " --tp 2 --sharding hybrid");
  EXPECT_TRUE(fs::is_regular_file(r.dir + "/tphsdp-part/checkpoints/last.ckpt"));
}

// --async-ckpt: checkpoints written in the background while training goes on, Full
// (consolidated) here (a single file, streamed to rank 0 by the background thread).
TEST_F(Gpt, ResumeFromAnAsyncFullCheckpointContinuesTheRun) {
  GptRun r;
  expect_resume_continues(r, "async", " --async-ckpt --state-dict full");
  EXPECT_TRUE(fs::is_regular_file(r.dir + "/async-part/checkpoints/last.ckpt"));
}

// A Full (consolidated) checkpoint streams each sharded tensor to rank 0 in slices: at 4
// ranks, a run that saves Full peaks within 64 MiB of the same run saving Sharded. (When
// every rank gathered the whole model and optimizer state first, this 12.7M-parameter
// model cost each rank ~150 MiB more.)
TEST_F(Gpt, FullCheckpointsCostNoMoreMemoryThanSharded) {
  GptRun r;
  const std::string common = " train --strategy fsdp --devices 4 --n-layer 4 --n-head 8 --d-model 512 --seq-len 32 "
                             "--batch-size 8 --max-steps 2 --val-every 0 --threads 1 --no-progress-bar --data " + r.data;
  std::map<std::string, double> peak;
  for (const std::string kind : {"sharded", "full"}) {
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + common + " --state-dict " + kind + " --out " + r.dir + "/" + kind);
    ASSERT_EQ(rc, 0) << out;
    const size_t at = out.find("peak_rss_mib=");
    ASSERT_NE(at, std::string::npos) << out;
    peak[kind] = std::atof(out.c_str() + at + 13);
    ASSERT_GT(peak[kind], 100) << out;
  }
  EXPECT_TRUE(fs::is_regular_file(r.dir + "/full/checkpoints/last.ckpt"));
  EXPECT_TRUE(fs::is_directory(r.dir + "/sharded/checkpoints/last.ckpt"));
  EXPECT_LE(peak["full"] - peak["sharded"], 64.0) << "peak RSS full " << peak["full"] << " MiB, sharded "
                                                  << peak["sharded"] << " MiB";
}

TEST_F(Gpt, BadFlagsNameTheFlag) {
  GptRun r;
  struct Case {
    std::string args, flag;
  };
  const std::vector<Case> cases = {
      {"train --strategy zero3", "--strategy"},
      {"train --sharding half", "--sharding"},
      {"train --precision 8", "--precision"},
      {"train --max-steps 0", "--max-steps"},
      {"train --devices 2 --batch-size 7", "--batch-size"},
      {"train --d-model 30 --n-head 4", "--d-model"},
      {"train --data " + r.dir + "/missing.txt", "--data"},
      {"train --strategy single --devices 2", "--strategy single"},
      {"train --max-steps 10 --warmup-steps 10", "--warmup-steps"},
      {"train --sharding grad-op --strategy ddp", "--sharding"},
      {"train --state-dict both", "--state-dict"},
      {"train --devices 2 --tp 3", "--tp"},
      {"train --devices 2 --tp 2 --n-head 3 --d-model 30", "--n-head"},
      {"train --devices 2 --tp 2 --seq-len 15", "--seq-len"},
      {"train --devices 2 --tp 2 --sharding hybrid --state-dict sharded", "--state-dict sharded"},
      {"train --max-steps 2 --resume " + r.dir + "/nothing --data " + r.data + " --out " + r.dir + "/o" + kTiny,
       "nothing"},
      {"sample --ckpt " + r.dir + "/nope", "--ckpt"},
      {"sample --ckpt " + r.data, r.data},
      {"sample --ckpt x --top-k 999", "--top-k"},
      {"bogus", "bogus"},
  };
  for (const auto& c : cases) {
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + " " + c.args);
    EXPECT_NE(rc, 0) << c.args << "\n" << out;
    EXPECT_NE(out.find(c.flag), std::string::npos) << c.args << " does not name " << c.flag << ":\n" << out;
  }
}
