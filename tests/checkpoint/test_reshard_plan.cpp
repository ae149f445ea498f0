// plan_reshard (checkpoint/offline/reshard_plan.h): the rules `tessera ckpt reshard --tp`
// gives each tensor, from metadata alone. Gpt.OfflineReshardToAnotherMeshResumesLikeTheOriginal
// checks them against real saves; these cases pin the arithmetic and the errors.
#include <gtest/gtest.h>

#include "support/test_util.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/reshard_plan.h"
#include "tessera/core/error.h"

namespace {

using tessera::checkpoint::CheckpointMetadata;
using tessera::checkpoint::EntryInfo;
using tessera::checkpoint::plan_reshard;
using tessera::checkpoint::ReshardTarget;
using tessera::sharding::Layout;

void add(CheckpointMetadata& m, const std::string& k, std::vector<int64_t> shape, Layout L) {
  EntryInfo e;
  e.kind = tessera::checkpoint::kShardedKind;
  e.shape = std::move(shape);
  e.layout = std::move(L);
  m.keys.push_back(k);
  m.entries.emplace(k, std::move(e));
}

// One FSDP unit saved at (dp 2, tp 2): a [8, 4] cut along dim 0 (16 elements per TP piece),
// a replicated [4] (4) and a [4, 8] cut along dim 1 (16): 36 elements per TP rank. Then
// the optimizer's states of the two cut ones only, as when the [4] is frozen: their unit
// has a gap, and they take the places of the parameters.
CheckpointMetadata two_d_unit() {
  CheckpointMetadata m;
  m.location = "/ckpt";
  m.world_size = 4;
  auto cut = [](int64_t dim, int64_t offset) {
    return Layout::tensor_parallel(dim, 1, 2, Layout::flat(36, offset, 2));
  };
  add(m, "a", {8, 4}, cut(0, 0));
  add(m, "b", {4}, Layout::flat(36, 16, 2));
  add(m, "c", {4, 8}, cut(1, 20));
  add(m, "opt.a", {8, 4}, cut(0, 0));
  add(m, "opt.c", {4, 8}, cut(1, 20));
  return m;
}

TEST(ReshardPlan, RebuildsTheUnitsAtTheNewTensorParallelSize) {
  const CheckpointMetadata m = two_d_unit();
  // (dp 2, tp 4): TP pieces of 8, 4 and 8 elements: a unit of 20, offsets 0, 8 and 12.
  CheckpointMetadata o = plan_reshard(m, ReshardTarget{8, 4});
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.version, 3);
  for (const std::string k : {"a", "opt.a"}) {
    const Layout& L = *o.entries.at(k).layout;
    EXPECT_EQ(L, Layout::tensor_parallel(0, 1, 4, Layout::flat(20, 0, 2))) << k;
  }
  for (const std::string k : {"c", "opt.c"})
    EXPECT_EQ(*o.entries.at(k).layout, Layout::tensor_parallel(1, 1, 4, Layout::flat(20, 12, 2))) << k;
  // The replicated one: FSDP's cut over each tp rank's data-parallel group, the groups
  // interleaved in the mesh, group (i + shift) mod tp storing piece i (key 1: shift 1).
  const Layout& b = *o.entries.at("b").layout;
  EXPECT_EQ(b.rule, Layout::Rule::Flat);
  EXPECT_EQ(b.flat_numel, 20);
  EXPECT_EQ(b.flat_offset, 8);
  EXPECT_EQ(b.pieces, 2);
  EXPECT_EQ(b.files.replicas, 4);
  EXPECT_EQ(b.files.step, 4);
  EXPECT_EQ(b.files.replica_step, 1);
  EXPECT_EQ(b.files.shift, 1);

  // FSDP alone over 4 ranks: the whole tensors, a unit of 68.
  o = plan_reshard(m, ReshardTarget{4, 1});
  EXPECT_EQ(o.version, 2);
  EXPECT_EQ(*o.entries.at("a").layout, Layout::flat(68, 0, 4));
  EXPECT_EQ(*o.entries.at("b").layout, Layout::flat(68, 32, 4));
  EXPECT_EQ(*o.entries.at("opt.c").layout, Layout::flat(68, 36, 4));

  // One data-parallel rank: each TP rank keeps its pieces whole and rank 0 the replicated one.
  o = plan_reshard(m, ReshardTarget{2, 2});
  EXPECT_EQ(*o.entries.at("a").layout, Layout::tensor_parallel(0, 1, 2, Layout::whole(0)));
  EXPECT_EQ(o.entries.at("b").kind, tessera::checkpoint::kTensorKind);
  EXPECT_EQ(*o.entries.at("b").layout, Layout::whole(0));
}

TEST(ReshardPlan, TensorsOutsideAnyUnitGetATorchChunkCut) {
  CheckpointMetadata m = two_d_unit();
  // At offset 4 of a unit of 36 that no earlier tensor reaches: no unit to place it in.
  add(m, "stray", {2, 4}, Layout::flat(36, 4, 2));
  const CheckpointMetadata o = plan_reshard(m, ReshardTarget{8, 4});
  EXPECT_EQ(*o.entries.at("stray").layout, Layout::chunk(0, 8));
  EXPECT_EQ(*o.entries.at("a").layout, Layout::tensor_parallel(0, 1, 4, Layout::flat(20, 0, 2)));
}

TEST(ReshardPlan, ErrorsNameTheFlagOrTheKey) {
  const CheckpointMetadata m = two_d_unit();
  EXPECT_CONTAINS(tessera::testing::error_of([&] { plan_reshard(m, ReshardTarget{6, 4}); }),
                  "--tp 4 does not divide --world-size 6");
  // Five rows of a [5, 4] do not cut into two equal pieces.
  CheckpointMetadata uneven = m;
  add(uneven, "odd", {10, 4}, Layout::tensor_parallel(0, 1, 2, Layout::flat(20, 0, 2)));
  EXPECT_CONTAINS(tessera::testing::error_of([&] { plan_reshard(uneven, ReshardTarget{8, 4}); }),
                  "key 'odd' (dim 0 of size 10 in 1 stripe(s)) does not cut into 4 equal pieces");
  // A 1-D checkpoint does not say what a tp-way job cuts.
  CheckpointMetadata flat;
  flat.location = "/flat";
  add(flat, "w", {8, 4}, Layout::flat(32, 0, 2));
  EXPECT_CONTAINS(tessera::testing::error_of([&] { plan_reshard(flat, ReshardTarget{4, 2}); }),
                  "'/flat' records no tensor-parallel cut");
  EXPECT_EQ(*plan_reshard(flat, ReshardTarget{4, 1}).entries.at("w").layout, Layout::flat(32, 0, 4));
}

}  // namespace
