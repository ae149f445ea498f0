// Tensor parallelism (parallel/): the cut arithmetic, the device mesh's checks, the
// modules at a group of one against their torch::nn twins, and, with real rank processes,
// the GPT example on (dp, tp) meshes under DDP and FSDP against one process, and the
// collectives a block issues.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "../../examples/gpt/model.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/parallel/mesh.h"
#include "tessera/parallel/plan.h"
#include "tessera/state/module_state.h"

using namespace tessera;
using namespace tessera::parallel;
using tessera::testing::error_of;
using tessera::testing::run_ranks;

TEST(TpCut, PiecesOfAStripedCutReassembleTheWhole) {
  at::Tensor w = at::arange(12 * 2, at::kFloat).reshape({12, 2});  // q, k, v stripes of 4 rows
  TpCut cut{0, 3, {12, 2}, 2, 0};
  cut.validate("qkv");
  // Piece 1 holds rows 2-3 of each stripe: 2, 3, 6, 7, 10, 11.
  at::Tensor p1 = cut.piece_of(w, 1);
  EXPECT_TRUE(at::equal(p1.select(1, 0), at::tensor({4.f, 6.f, 12.f, 14.f, 20.f, 22.f})));
  EXPECT_EQ(cut.local_shape(1), (std::vector<int64_t>{6, 2}));
  EXPECT_TRUE(at::equal(cut.assemble({cut.piece_of(w, 0), p1}), w));
}

TEST(TpCut, UnevenCutsFollowTorchChunkAndReassemble) {
  at::Tensor w = at::randn({3, 10});
  TpCut cut{1, 1, {3, 10}, 4, 0};  // 10 columns over 4: 3, 3, 3, 1
  std::vector<at::Tensor> pieces;
  std::vector<int64_t> widths;
  for (int i = 0; i < 4; ++i) {
    pieces.push_back(cut.piece_of(w, i));
    widths.push_back(pieces.back().size(1));
  }
  EXPECT_EQ(widths, (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_TRUE(at::equal(cut.assemble(pieces), w));
}

TEST(TpCut, AStripeCountThatDoesNotDivideIsRefusedByName) {
  TpCut cut{0, 3, {10, 2}, 2, 0};
  const std::string msg = error_of([&] { cut.validate("blocks.0.qkv.weight"); });
  EXPECT_NE(msg.find("blocks.0.qkv.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 equal stripes"), std::string::npos) << msg;
}

TEST(DeviceMesh, SizesThatDoNotMultiplyToTheWorldAreRefusedNamingThem) {
  const std::string msg = error_of([] { DeviceMesh m(nullptr, {{"dp", 2}, {"tp", 2}}); });
  EXPECT_NE(msg.find("(dp=2, tp=2)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1 ranks"), std::string::npos) << msg;
  const std::string dup = error_of([] { DeviceMesh m(nullptr, {{"tp", 1}, {"tp", 1}}); });
  EXPECT_NE(dup.find("'tp' appears twice"), std::string::npos) << dup;
  DeviceMesh ok(nullptr, {{"dp", 1}, {"tp", 1}});
  EXPECT_EQ(ok.comm("tp")->size(), 1);
  EXPECT_EQ(ok.describe(), "(dp=1, tp=1)");
  const std::string unknown = error_of([&] { ok.size("pp"); });
  EXPECT_NE(unknown.find("no dimension 'pp'"), std::string::npos) << unknown;
}

// At a group of one the modules are their torch::nn twins: the same draws, the same output.
TEST(TensorParallelModules, AtOneRankTheyAreTheTorchModules) {
  TensorParallel none;
  at::manual_seed(3);
  torch::nn::Linear lin(5, 6);
  torch::nn::Embedding emb(7, 4);
  at::manual_seed(3);
  ColumnParallelLinear col(5, 6, none);
  VocabParallelEmbedding vemb(7, 4, none);
  EXPECT_TRUE(at::equal(col->weight, lin->weight));
  EXPECT_TRUE(at::equal(col->bias, lin->bias));
  EXPECT_TRUE(at::equal(vemb->weight, emb->weight));
  at::Tensor x = at::randn({2, 3, 5});
  EXPECT_TRUE(at::equal(col(x), lin(x)));
  at::manual_seed(3);
  RowParallelLinear row(5, 6, none);
  EXPECT_TRUE(at::equal(row->weight, lin->weight));
  EXPECT_TRUE(at::allclose(row(x), lin(x), 1e-6, 1e-6));
  torch::nn::LayerNorm ln(torch::nn::LayerNormOptions({5}));
  EXPECT_TRUE(at::equal(LayerNorm(5, none)(x), ln(x)));
}

TEST(TensorParallelModules, CrossEntropyAtOneRankIsTorchs) {
  at::Tensor logits = at::randn({3, 5, 11}).requires_grad_();
  at::Tensor targets = at::randint(11, {3, 5}, at::kLong);
  at::Tensor ours = vocab_parallel_cross_entropy(logits, targets, 0, TensorParallel{});
  at::Tensor g_ours = torch::autograd::grad({ours}, {logits})[0];
  at::Tensor theirs = at::cross_entropy_loss(logits.reshape({-1, 11}), targets.reshape({-1}));
  at::Tensor g_theirs = torch::autograd::grad({theirs}, {logits})[0];
  EXPECT_NEAR(ours.item<double>(), theirs.item<double>(), 1e-6);
  EXPECT_TRUE(at::allclose(g_ours, g_theirs, 1e-6, 1e-7));
}

// The GPT written with the tensor-parallel modules has the names and shapes it had with
// torch::nn's (the checkpoints' keys): the expected list is the model's documented one.
TEST(TensorParallelModules, GptKeepsItsNamesAndShapes) {
  gpt::Config c;
  c.n_layer = 1;
  c.d_model = 8;
  c.n_head = 2;
  c.seq_len = 4;
  gpt::Gpt model(c);
  std::vector<std::string> names;
  for (auto& kv : model->named_parameters()) names.push_back(kv.key() + ":" + c10::str(kv.value().sizes()));
  EXPECT_EQ(names, (std::vector<std::string>{
                       "tok.weight:[256, 8]", "pos.weight:[4, 8]", "blocks.0.ln1.weight:[8]", "blocks.0.ln1.bias:[8]",
                       "blocks.0.qkv.weight:[24, 8]", "blocks.0.qkv.bias:[24]", "blocks.0.proj.weight:[8, 8]",
                       "blocks.0.proj.bias:[8]", "blocks.0.ln2.weight:[8]", "blocks.0.ln2.bias:[8]",
                       "blocks.0.fc.weight:[32, 8]", "blocks.0.fc.bias:[32]", "blocks.0.fc_out.weight:[8, 32]",
                       "blocks.0.fc_out.bias:[8]", "ln_f.weight:[8]", "ln_f.bias:[8]", "head.weight:[256, 8]"}));
}

namespace {

void expect_tp_parity(int ranks, const std::string& kinds, int tp, const std::string& configs) {
  auto res = run_ranks(ranks, {"tp_parity", kinds, std::to_string(tp), configs, "50"}, 600);
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < ranks; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "tp parity ok rank " + std::to_string(r)) << res.all_output();
  }
}

}  // namespace

// 50 AdamW steps (fp32, gradient clipping engaged) of the GPT on a (dp, tp) mesh: every
// step's loss and global gradient norm within 1e-5 of one process's on the same global
// batch, and the final full state dict the plain model's (names, global shapes, values).
TEST(TensorParallelParity, PureTensorParallelTwoRanks) {
  expect_tp_parity(2, "ddp,fsdp", 2, "sp-untied,nosp-untied,sp-tied,nosp-tied");
}
TEST(TensorParallelParity, FsdpTimesTensorParallelOnTwoByTwo) {
  expect_tp_parity(4, "fsdp", 2, "sp-untied,nosp-untied,sp-tied,nosp-tied");
}
TEST(TensorParallelParity, DdpTimesTensorParallelOnTwoByTwo) {
  expect_tp_parity(4, "ddp", 2, "sp-untied,nosp-tied");
}
TEST(TensorParallelParity, PureTensorParallelFourRanks) { expect_tp_parity(4, "fsdp,ddp", 4, "sp-tied,nosp-untied"); }
// Activation checkpointing (FSDP) and gradient accumulation under no_sync (FSDP and DDP)
// on the (2, 2) mesh, as without tensor parallelism.
TEST(TensorParallelParity, CheckpointingAndAccumulationOnTwoByTwo) {
  expect_tp_parity(4, "fsdp-ckpt,fsdp-accum,ddp-accum", 2, "sp-untied,nosp-tied");
}
// A 3-D mesh, (replicate 2, shard 2, tp 2) on 8 ranks: FSDP's HYBRID_SHARD over the data-
// parallel dimension (shard groups of 2 dp ranks, gradients all-reduced across the 2
// replica groups), tensor parallel inside.
TEST(TensorParallelParity, HybridShardTimesTensorParallelOnAThreeDimensionalMesh) {
  expect_tp_parity(8, "hsdp", 2, "sp-untied,nosp-tied");
}
// bf16 compute parameters under FSDP x TP (fp32 masters, optimizer and reductions): every
// step's loss within 5e-3 of one fp32 process's (and further than 1e-5: bf16 is in use).
TEST(TensorParallelParity, Bf16ComputeUnderFsdpTimesTensorParallel) {
  expect_tp_parity(4, "fsdp-bf16", 2, "sp-untied,nosp-tied");
}
// A vocabulary that does not divide over the group (256 over 3: 86, 86, 84 rows).
TEST(TensorParallelParity, UnevenVocabularyOverThreeRanks) { expect_tp_parity(3, "fsdp,ddp", 3, "sp-untied,nosp-tied"); }

// One block's collectives over the tensor-parallel group, forward and backward:
// without sequence parallelism Megatron's four all-reduces (two forward after the row-
// parallel layers, two backward before the column-parallel ones); with it, each becomes an
// all-gather and a reduce-scatter, plus one all-reduce per replicated parameter inside
// the sequence-parallel region (the two norms' weight and bias, and the row-parallel
// layers' biases: six). Their bytes are the analytic figures exactly: each activation
// collective moves the whole [batch 2, seq 16, d 32] fp32 activation A (4,096 bytes), so
// 4A of all-reduce without sequence parallelism; with it 4A gathered, 4A reduce-scattered
// and six d-vectors all-reduced (6 x 32 x 4 bytes).
TEST(TensorParallelCollectives, OneBlockIssuesMegatronsCollectives) {
  auto res = run_ranks(2, {"tp_collectives"}, 120);
  EXPECT_RANKS_OK(res);
  const int64_t A = 2 * 16 * 32 * 4, d = 32 * 4;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(res.out[r].size(), 2u) << res.all_output();
    EXPECT_EQ(res.out[r][0], "counts sp=0 4 0 0 0 bytes " + std::to_string(4 * A) + " 0 0") << res.all_output();
    EXPECT_EQ(res.out[r][1], "counts sp=1 6 4 4 0 bytes " + std::to_string(6 * d) + " " + std::to_string(4 * A) + " " +
                                 std::to_string(4 * A))
        << res.all_output();
  }
}

// A plan by FQN over a model of torch::nn modules: two ranks cut a Sequential MLP (Colwise,
// Rowwise) and compute its output, whole and under sequence parallelism, under the same names.
TEST(TensorParallelPlan, ASequentialOfTorchModulesIsCutByFqn) {
  auto res = run_ranks(2, {"tp_plan"}, 120);
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "plan ok rank " + std::to_string(r)) << res.all_output();
  }
}

namespace {
struct HolderImpl : torch::nn::Module {
  torch::nn::Linear member{nullptr};
  torch::nn::Sequential seq;
  HolderImpl() {
    member = register_module("member", torch::nn::Linear(2, 2));
    seq = register_module("seq", torch::nn::Sequential(torch::nn::Linear(2, 4), torch::nn::LayerNorm(
                                                                                    torch::nn::LayerNormOptions({4}))));
  }
};
TORCH_MODULE(Holder);
}  // namespace

// What a plan cannot cut is refused by FQN, and then nothing is replaced.
TEST(TensorParallelPlan, WhatAPlanCannotCutIsRefusedByName) {
  Holder h;
  TensorParallel none;
  std::string msg = error_of([&] { parallelize(*h, {{"member", TpStyle::Colwise}}, none); });
  EXPECT_NE(msg.find("'member' is not an element of a torch::nn::Sequential"), std::string::npos) << msg;
  msg = error_of([&] { parallelize(*h, {{"seq.1", TpStyle::Colwise}}, none); });
  EXPECT_NE(msg.find("'seq.1' is a torch::nn::LayerNormImpl"), std::string::npos) << msg;
  msg = error_of([&] { parallelize(*h, {{"seq.0", TpStyle::Colwise}, {"seq.7", TpStyle::Rowwise}}, none); });
  EXPECT_NE(msg.find("'seq.7', which is not a module of the model"), std::string::npos) << msg;
  EXPECT_NE(dynamic_cast<torch::nn::LinearImpl*>(h->seq->ptr(0).get()), nullptr) << "replaced despite the error";
  EXPECT_EQ(parallelize(*h, {{"seq.0", TpStyle::Colwise}}, none), 1);
  EXPECT_NE(dynamic_cast<ColumnParallelLinearImpl*>(h->seq->ptr(0).get()), nullptr);
}

namespace {

// tp_resume over 4 ranks: SRC's checkpoint resumed at DST (KIND:TP).
void expect_tp_resume(const std::string& src, const std::string& dst) {
  const std::string dir = tessera::testing::temp_dir("tessera-tp-resume");
  auto res = run_ranks(4, {"tp_resume", dir, src, dst, "4", "4"}, 300);
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < 4; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back().rfind("tp resume " + src + " -> " + dst + " ok rank " + std::to_string(r), 0), 0u)
        << res.all_output();
  }
}

}  // namespace

// A sharded checkpoint of a tensor-parallel model (its cut parameters in 2-D tp layouts,
// the AdamW moments with them) resumed on the mesh it was saved on: the next 4 steps'
// losses bit for bit those of the run that went on.
TEST(TensorParallelCheckpoint, SameMeshResumeIsBitExact) {
  expect_tp_resume("fsdp:2", "fsdp:2");
  expect_tp_resume("ddp:2", "ddp:2");
}
// Saved on (2, 2) under FSDP, resumed on (1, 4), as 1-D FSDP over 4, as DDP x TP and as
// plain DDP: each rank reads the pieces it holds there; losses within 1e-5.
TEST(TensorParallelCheckpoint, FsdpTimesTpCheckpointResumesOnEveryOtherMesh) {
  for (const char* dst : {"fsdp:4", "fsdp:1", "ddp:2", "ddp:1"}) expect_tp_resume("fsdp:2", dst);
}
// 1-D checkpoints (FSDP over 4, DDP) and DDP x TP's resumed by a 2-D FSDP x TP run.
TEST(TensorParallelCheckpoint, OneDimensionalCheckpointsResumeInTwoDimensions) {
  for (const char* src : {"fsdp:1", "ddp:1", "ddp:2"}) expect_tp_resume(src, "fsdp:2");
}
