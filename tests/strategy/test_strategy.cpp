// Strategy parity with real rank processes: DDP and FSDP (every sharding strategy)
// against single-process training on the same global batch.
#include <ATen/ATen.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"

using tessera::testing::run_ranks;

namespace {

void expect_parity(int n, const std::string& kinds, const std::string& steps, const std::string& clip = "0",
                   const std::string& micro = "1", std::map<std::string, std::string> env = {}) {
  auto res = run_ranks(n, {"strategy_parity", kinds, steps, clip, micro}, 240, std::move(env));
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(res.out[r].empty()) << res.all_output();
    if (res.out[r].empty()) continue;
    EXPECT_EQ(res.out[r].back(), "parity ok rank " + std::to_string(r)) << res.all_output();
  }
  // One line per strategy kind on every rank.
  size_t kinds_n = std::count(kinds.begin(), kinds.end(), ',') + 1;
  EXPECT_EQ(res.out[0].size(), kinds_n + 1) << res.all_output();
}

}  // namespace

class StrategyParity : public ::testing::TestWithParam<int> {};

// 50 steps of Adam, fp32, every strategy, loss and final parameters within 1e-5.
TEST_P(StrategyParity, EveryStrategyMatchesSingleProcess) {
  expect_parity(GetParam(), "ddp,ddp_small_buckets,ddp_grad_copy,full,grad_op,no_shard,hybrid", "50");
}

// Gradient clipping by the global norm: the norm each strategy reports equals the
// single-process norm at every step (and training still matches).
TEST_P(StrategyParity, GlobalNormClipping) { expect_parity(GetParam(), "ddp,full,hybrid", "20", "0.35"); }

// Two micro-batches with no_sync on the first equal one step on the large batch.
TEST_P(StrategyParity, NoSyncAccumulationEqualsLargeBatch) {
  expect_parity(GetParam(), "ddp,full,grad_op,no_shard", "10", "0", "2");
}

// Activation checkpointing, no prefetch and CPU offload change nothing numerically.
TEST_P(StrategyParity, CheckpointingPrefetchOffloadVariants) {
  expect_parity(GetParam(), "full_ckpt,full_noprefetch,full_offload", "10");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StrategyParity, ::testing::Values(1, 2, 3, 4));

// The same parity with collectives over Gloo instead of the shared-memory channel (the
// path between hosts): DDP's all-reduce, FSDP's all-gather / reduce-scatter.
TEST(StrategyParityOverGloo, DdpAndFsdpMatchSingleProcess) {
  for (int n : {2, 3}) expect_parity(n, "ddp,full,grad_op,hybrid", "20", "0.35", "1", {{"TESSERA_SHM", "0"}});
}

namespace {
tessera::testing::RanksResult expect_ok_lines(int n, const std::vector<std::string>& args,
                                             const std::string& last_prefix) {
  auto res = run_ranks(n, args, 240);
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < n; ++r) {
    EXPECT_FALSE(res.out[r].empty()) << res.all_output();
    if (res.out[r].empty()) continue;
    EXPECT_EQ(res.out[r].back(), last_prefix + " rank " + std::to_string(r)) << res.all_output();
  }
  std::cout << res.all_output();
  return res;
}
}  // namespace

class StrategyRanks : public ::testing::TestWithParam<int> {};

// Parameter shards + gradient shards + Adam state per rank ~ 1/N of one process.
TEST_P(StrategyRanks, MemoryAccountingIsOneOverN) { expect_ok_lines(GetParam(), {"strategy_memory"}, "memory ok"); }

// bf16 compute parameters, fp32 master shards: tracks fp32 within 1% per step (measured ~0.1%).
TEST_P(StrategyRanks, MixedPrecisionTracksFp32) { expect_ok_lines(GetParam(), {"strategy_bf16"}, "bf16 ok"); }

// A float64 model is gathered, computed and reduced in float64 (1e-12 of one process).
TEST_P(StrategyRanks, Float64ModelsStayFloat64) { expect_ok_lines(GetParam(), {"strategy_fp64"}, "fp64 ok"); }

// Units marked explicitly and built through init_module (sharded unit by unit).
TEST_P(StrategyRanks, ExplicitUnitsAndDeferredInit) {
  expect_ok_lines(GetParam(), {"strategy_explicit_units"}, "explicit units ok");
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StrategyRanks, ::testing::Values(1, 2, 4));

// Train 3 steps with FSDP on 2 ranks, save sharded (model + Adam state), then load
// into FSDP on 3 and 1 ranks, DDP on 2 ranks and one plain process, and continue:
// every loss equals the uninterrupted single-process run.
TEST(StrategyResume, ShardedCheckpointLoadsAtOtherWorldSizesAndStrategies) {
  const std::string dir = tessera::testing::temp_dir("tessera_strategy_resume") + "/ckpt";
  expect_ok_lines(2, {"strategy_resume", "save", "full", dir, "3"}, "saved");
  expect_ok_lines(3, {"strategy_resume", "load", "full", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(1, {"strategy_resume", "load", "full", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(2, {"strategy_resume", "load", "ddp", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(1, {"strategy_resume", "load", "single", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(4, {"strategy_resume", "load", "grad_op", dir, "3", "3"}, "resumed ok");
}

// Collectives counted per kind on the strategies' communicators: none for gradients
// under no_sync (FSDP, NO_SHARD, DDP), one reduction per unit or bucket when synced, and
// fewer all-gathers for SHARD_GRAD_OP (3 per step) than FULL_SHARD (4).
TEST(StrategyCollectives, NoSyncAndShardGradOpIssueTheCollectivesTheyPromise) {
  for (int n : {2, 3}) expect_ok_lines(n, {"strategy_collective_counts"}, "collective counts ok");
}

// CPU offload: master shards, gradients and Adam state on the CPU between steps, the
// compute copy gathered per step and freed (also on one rank, unlike without offload).
TEST(StrategyCollectives, CpuOffloadKeepsShardsAndFreesTheComputeCopy) {
  for (int n : {1, 2}) expect_ok_lines(n, {"strategy_offload_placement"}, "offload placement ok");
}

// find_unused_parameters on 2 ranks using different heads (swapped every step): each
// rank's gradients equal the average with zeros where unused; a parameter no rank used
// has none.
TEST(StrategyCollectives, DdpFindUnusedParametersAcrossRanks) {
  expect_ok_lines(2, {"ddp_unused_parameters"}, "ddp unused ok");
}

// HYBRID_SHARD with two replica groups (4 ranks: 2 shard groups of 2) saves a sharded
// checkpoint: each box is written by one rank (the replica groups share the writing),
// the checkpoint verifies, every rank reads its own state back bit for bit, and it
// resumes at other world sizes and strategies. The other way round too: FULL_SHARD's
// checkpoint resumes under HYBRID_SHARD.
TEST(StrategyResume, HybridWithTwoReplicaGroupsSavesShardedAndLoadsAnywhere) {
  const std::string tmp = tessera::testing::temp_dir("tessera_strategy_hybrid");
  const std::string dir = tmp + "/hybrid", full_dir = tmp + "/full";
  auto saved = expect_ok_lines(4, {"strategy_resume", "save", "hybrid", dir, "3"}, "saved");
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(std::find(saved.out[r].begin(), saved.out[r].end(), "shard group 2 of 4, replica group size 2"),
              saved.out[r].end())
        << "rank " << r << " is not in a 2 x 2 hybrid layout\n" << saved.all_output();
  auto v = tessera::checkpoint::verify(dir);
  std::string problems;
  for (const auto& p : v.problems) problems += p + "\n";
  EXPECT_TRUE(v.ok) << problems;
  // One file per rank, and every rank wrote part of the model: both replica groups write.
  tessera::testing::downgrade_to_v1(dir);  // every chunk with its file
  auto meta = nlohmann::json::parse(tessera::testing::read_bytes(dir + "/tessera-checkpoint.json"));
  EXPECT_EQ(meta["world_size"], 4);
  ASSERT_EQ(meta["files"].size(), 4u);
  std::map<std::string, int> chunks_in;
  for (auto& [k, e] : meta["entries"].items())
    if (e.contains("chunks"))
      for (auto& c : e["chunks"]) ++chunks_in[c["file"].get<std::string>()];
  for (auto& f : meta["files"])
    EXPECT_GT(chunks_in[f["name"].get<std::string>()], 0) << f["name"] << " holds no chunk";

  expect_ok_lines(4, {"strategy_resume", "load", "hybrid", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(2, {"strategy_resume", "load", "hybrid", dir, "3", "3"}, "resumed ok");  // one shard group
  expect_ok_lines(3, {"strategy_resume", "load", "full", dir, "3", "3"}, "resumed ok");
  expect_ok_lines(1, {"strategy_resume", "load", "single", dir, "3", "3"}, "resumed ok");

  expect_ok_lines(4, {"strategy_resume", "save", "full", full_dir, "3"}, "saved");
  expect_ok_lines(4, {"strategy_resume", "load", "hybrid", full_dir, "3", "3"}, "resumed ok");

  // A consolidated save under HYBRID_SHARD: every rank writes its rows into the one
  // file, each box once although two replica groups hold it (a box written twice or
  // not at all fails the save's checksum assembly), and it resumes elsewhere.
  const std::string file = tmp + "/hybrid.safetensors";
  expect_ok_lines(4, {"strategy_resume", "save", "hybrid", file, "3"}, "saved");
  EXPECT_TRUE(tessera::checkpoint::verify(file).ok);
  expect_ok_lines(2, {"strategy_resume", "load", "full", file, "3", "3"}, "resumed ok");
}
