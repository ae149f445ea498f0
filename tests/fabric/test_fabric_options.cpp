// Fabric configuration errors and the distributed sampler (in-process).
#include <gtest/gtest.h>
#include <torch/data/dataloader.h>
#include <torch/data/datasets/tensor.h>

#include <set>
#include <tuple>

#include "support/test_util.h"
#include "tessera/fabric/fabric.h"

using namespace tessera;
using namespace tessera::fabric;

namespace {

// Expects resolve(o) to fail with a message containing every fragment.
void expect_refused(const FabricOptions& o, std::vector<std::string> fragments, int gpus = 0) {
  try {
    resolve(o, gpus);
    ADD_FAILURE() << "options accepted; expected an error mentioning " << fragments[0];
  } catch (const Error& e) {
    for (auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

FabricOptions opts(std::string accel, std::string strat, int devices, std::string precision = "32") {
  FabricOptions o;
  o.accelerator = std::move(accel);
  o.strategy = std::move(strat);
  o.devices = devices;
  o.precision = std::move(precision);
  return o;
}

}  // namespace

TEST(FabricOptions, RefusesUnknownStrings) {
  expect_refused(opts("tpu", "ddp", 1), {"FabricOptions.accelerator", "'tpu'"});
  expect_refused(opts("cpu", "deepspeed", 1), {"FabricOptions.strategy", "'deepspeed'"});
  expect_refused(opts("cpu", "ddp", 1, "64"), {"FabricOptions.precision", "'64'"});
  expect_refused(opts("cpu", "ddp", 1, "bf16"), {"FabricOptions.precision"});
}

TEST(FabricOptions, RefusesInvalidCombinations) {
  expect_refused(opts("cuda", "ddp", 1), {"FabricOptions.accelerator", "cuda", "no CUDA"}, /*gpus=*/0);
  expect_refused(opts("cuda", "ddp", 4), {"FabricOptions.devices=4", "2 GPU"}, /*gpus=*/2);
  expect_refused(opts("cpu", "single", 2), {"FabricOptions.strategy", "\"single\"", "devices=2"});
  expect_refused(opts("cpu", "ddp", 0), {"FabricOptions.devices"});
  FabricOptions nodes = opts("cpu", "single", 1);
  nodes.num_nodes = 2;
  expect_refused(nodes, {"FabricOptions.strategy", "num_nodes=2"});
  nodes.num_nodes = 0;
  expect_refused(nodes, {"FabricOptions.num_nodes"});
  expect_refused(opts("cpu", "ddp", 1, "16-mixed"), {"FabricOptions.precision", "16-mixed", "cuda"});
  expect_refused(opts("auto", "fsdp", 1, "16-mixed"), {"FabricOptions.precision"}, /*gpus=*/0);
  FabricOptions off = opts("cpu", "ddp", 2);
  off.fsdp.cpu_offload = true;
  expect_refused(off, {"FabricOptions.fsdp", "\"ddp\""});
  // The constructor runs the same checks.
  EXPECT_THROW(Fabric(opts("cpu", "single", 3)), Error);
}

TEST(FabricOptions, ResolvesAutoValues) {
  ResolvedOptions r = resolve(opts("auto", "auto", 1), /*gpus=*/0);
  EXPECT_EQ(r.accelerator, "cpu");
  EXPECT_EQ(r.strategy, "single");
  EXPECT_EQ(r.state_dict_type, strategy::StateDictType::Full);
  r = resolve(opts("auto", "auto", 2), /*gpus=*/2);
  EXPECT_EQ(r.accelerator, "cuda");
  EXPECT_EQ(r.strategy, "ddp");
  r = resolve(opts("cpu", "fsdp", 2, "bf16-mixed"), 0);
  EXPECT_EQ(r.state_dict_type, strategy::StateDictType::Sharded);  // Fabric FSDP default
  ASSERT_TRUE(r.options.fsdp.mixed_precision.param_dtype.has_value());
  EXPECT_EQ(*r.options.fsdp.mixed_precision.param_dtype, at::kBFloat16);
  ASSERT_TRUE(r.autocast_dtype.has_value());
  FabricOptions full = opts("cpu", "fsdp", 2);
  full.state_dict_type = strategy::StateDictType::Full;
  EXPECT_EQ(resolve(full, 0).state_dict_type, strategy::StateDictType::Full);
  EXPECT_EQ(resolve(opts("cuda", "fsdp", 1, "16-mixed"), 1).autocast_dtype, at::kHalf);
}

// The kinds resolve() decides, beside the strings it keeps filling.
TEST(FabricOptions, ResolvesKindsBesideTheStrings) {
  ResolvedOptions r = resolve(opts("auto", "auto", 1), /*gpus=*/0);
  EXPECT_EQ(r.accelerator_kind, Accelerator::Cpu);
  EXPECT_EQ(r.strategy_kind, strategy::StrategyKind::Single);
  EXPECT_EQ(r.precision, Precision::F32);
  r = resolve(opts("auto", "auto", 2, "16-mixed"), /*gpus=*/2);
  EXPECT_EQ(r.accelerator_kind, Accelerator::Cuda);
  EXPECT_EQ(r.strategy_kind, strategy::StrategyKind::Ddp);
  EXPECT_EQ(r.precision, Precision::F16Mixed);
  r = resolve(opts("cpu", "fsdp", 2, "bf16-mixed"), 0);
  EXPECT_EQ(r.strategy_kind, strategy::StrategyKind::Fsdp);
  EXPECT_EQ(r.precision, Precision::Bf16Mixed);
  for (const auto& [accel, strat, devices, precision, gpus] :
       std::vector<std::tuple<std::string, std::string, int, std::string, int>>{
           {"auto", "auto", 1, "32", 0}, {"cpu", "ddp", 3, "bf16-mixed", 0}, {"cuda", "fsdp", 2, "16-mixed", 2}}) {
    r = resolve(opts(accel, strat, devices, precision), gpus);
    EXPECT_EQ(r.accelerator, to_string(r.accelerator_kind));
    EXPECT_EQ(r.strategy, strategy::to_string(r.strategy_kind));
    EXPECT_EQ(r.options.precision, to_string(r.precision));
  }
}

// The parse functions of the options' strings: every kind through its name and back,
// "auto" for the accelerator and the strategy, and an unknown value refused naming the
// option, word for word as resolve() refuses it.
TEST(FabricOptions, ParsesItsStringsOnce) {
  for (Accelerator a : {Accelerator::Cpu, Accelerator::Cuda}) EXPECT_EQ(parse_accelerator(to_string(a)), a);
  for (Precision p : {Precision::F32, Precision::Bf16Mixed, Precision::F16Mixed})
    EXPECT_EQ(parse_precision(to_string(p)), p);
  for (const std::string& n : strategy::strategy_names())
    EXPECT_EQ(fabric::parse_strategy(n), strategy::parse_strategy(n));
  EXPECT_EQ(parse_accelerator("auto"), std::nullopt);
  EXPECT_EQ(fabric::parse_strategy("auto"), std::nullopt);
  EXPECT_STREQ(to_string(Accelerator::Cuda), "cuda");
  EXPECT_STREQ(to_string(Precision::Bf16Mixed), "bf16-mixed");
  EXPECT_STREQ(to_string(Precision::F32), "32");

  const std::string accel = "FabricOptions.accelerator: unknown value 'tpu' (expected \"cpu\", \"cuda\" or \"auto\")";
  const std::string strat =
      "FabricOptions.strategy: unknown value 'deepspeed' (expected \"auto\", \"single\", \"ddp\" or \"fsdp\")";
  const std::string prec =
      "FabricOptions.precision: unknown value 'bf16' (expected \"32\", \"bf16-mixed\" or \"16-mixed\")";
  using tessera::testing::error_of;
  EXPECT_EQ(error_of([] { parse_accelerator("tpu"); }), accel);
  EXPECT_EQ(error_of([] { fabric::parse_strategy("deepspeed"); }), strat);
  EXPECT_EQ(error_of([] { parse_precision("bf16"); }), prec);
  EXPECT_EQ(error_of([] { parse_precision("auto"); }),
            "FabricOptions.precision: unknown value 'auto' (expected \"32\", \"bf16-mixed\" or \"16-mixed\")");
  EXPECT_EQ(error_of([&] { resolve(opts("tpu", "ddp", 1), 0); }), accel);
  EXPECT_EQ(error_of([&] { resolve(opts("cpu", "deepspeed", 1), 0); }), strat);
  EXPECT_EQ(error_of([&] { resolve(opts("cpu", "ddp", 1, "bf16"), 0); }), prec);
}

// --- DistributedSampler: the semantics of torch.utils.data.DistributedSampler ---

TEST(FabricSampler, PadsOrDropsLikeTorch) {
  SamplerOptions o;
  o.shuffle = false;
  // 10 samples over 3 ranks: padded to 12 by repeating from the start.
  EXPECT_EQ(distributed_indices(10, 3, 0, o, 0), (std::vector<size_t>{0, 3, 6, 9}));
  EXPECT_EQ(distributed_indices(10, 3, 1, o, 0), (std::vector<size_t>{1, 4, 7, 0}));
  EXPECT_EQ(distributed_indices(10, 3, 2, o, 0), (std::vector<size_t>{2, 5, 8, 1}));
  o.drop_last = true;  // the tail is dropped: 3 each
  EXPECT_EQ(distributed_indices(10, 3, 0, o, 0), (std::vector<size_t>{0, 3, 6}));
  EXPECT_EQ(distributed_indices(10, 3, 2, o, 0), (std::vector<size_t>{2, 5, 8}));
  // Fewer samples than ranks: padding repeats the list more than once.
  o.drop_last = false;
  EXPECT_EQ(distributed_indices(2, 5, 4, o, 0), (std::vector<size_t>{0}));
  EXPECT_EQ(distributed_indices(2, 5, 3, o, 0), (std::vector<size_t>{1}));
  EXPECT_THROW(distributed_indices(10, 3, 3, o, 0), Error);
}

TEST(FabricSampler, ShufflesPerEpochIdenticallyOnEveryRank) {
  SamplerOptions o;
  o.seed = 11;
  std::multiset<size_t> seen;
  for (int r = 0; r < 4; ++r)
    for (size_t i : distributed_indices(22, 4, r, o, 3)) seen.insert(i);
  EXPECT_EQ(seen.size(), 24u);  // 22 padded to 24
  for (size_t i = 0; i < 22; ++i) EXPECT_GE(seen.count(i), 1u) << i;
  EXPECT_EQ(distributed_indices(22, 4, 1, o, 3), distributed_indices(22, 4, 1, o, 3));
  EXPECT_NE(distributed_indices(100, 2, 0, o, 3), distributed_indices(100, 2, 0, o, 4));
  SamplerOptions other = o;
  other.seed = 12;
  EXPECT_NE(distributed_indices(100, 2, 0, o, 3), distributed_indices(100, 2, 0, other, 3));
  auto plain = distributed_indices(100, 1, 0, SamplerOptions{false, 0, false}, 0);
  EXPECT_NE(distributed_indices(100, 1, 0, o, 0), plain);
}

TEST(FabricSampler, ResumesMidEpochExactly) {
  DistributedSampler a(50, 2, 1, {true, 3, false});
  a.set_epoch(2);
  a.next(4);
  a.next(4);
  state::StateDict st = a.state();
  auto expected = a.next(4);
  DistributedSampler b(50, 2, 1, {true, 999, false});
  b.load_state(st);
  EXPECT_EQ(b.epoch(), 2);
  EXPECT_EQ(b.position(), 8u);
  EXPECT_EQ(b.next(4), expected);
  // Another world size is refused, naming the field.
  DistributedSampler c(50, 4, 1, {});
  try {
    c.load_state(st);
    ADD_FAILURE() << "load_state accepted another num_replicas";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_replicas"), std::string::npos) << e.what();
  }
  // End of epoch, then set_epoch rewinds.
  while (b.next(7)) {
  }
  EXPECT_EQ(b.position(), b.num_samples());
  b.set_epoch(3);
  EXPECT_EQ(b.position(), 0u);
}

TEST(FabricSampler, DrivesATorchDataLoader) {
  at::Tensor data = at::arange(9, at::kFloat).unsqueeze(1);
  auto ds = torch::data::datasets::TensorDataset(data);
  DistributedSampler sampler(9, 2, 1, {false, 0, true});  // rank 1 of 2, drop_last: 4 samples
  auto loader = torch::data::make_data_loader(ds, sampler, torch::data::DataLoaderOptions().batch_size(3));
  std::vector<float> got;
  for (auto& batch : *loader)
    for (auto& ex : batch) got.push_back(ex.data.item<float>());
  EXPECT_EQ(got, (std::vector<float>{1, 3, 5, 7}));
}

// Tensor parallelism: the group must divide the ranks of a node; hybrid sharding (a 3-D
// mesh) and sharded checkpoints are refused with it for now, naming the option; otherwise the
// data-parallel size is world / tp and checkpoints are full.
TEST(FabricOptions, TensorParallelSizeIsCheckedAndSplitsTheWorld) {
  FabricOptions o;
  o.devices = 4;
  o.strategy = "fsdp";
  o.tensor_parallel_size = 2;
  ResolvedOptions r = resolve(o, 0);
  EXPECT_EQ(r.data_parallel_size(), 2);
  EXPECT_EQ(r.tensor_parallel_size(), 2);
  EXPECT_EQ(r.state_dict_type, strategy::StateDictType::Sharded);  // FSDP's default: 2-D sharded checkpoints
  o.tensor_parallel_size = 3;
  std::string msg = tessera::testing::error_of([&] { resolve(o, 0); });
  EXPECT_NE(msg.find("FabricOptions.tensor_parallel_size=3 does not divide devices=4"), std::string::npos) << msg;
  o.tensor_parallel_size = 0;
  msg = tessera::testing::error_of([&] { resolve(o, 0); });
  EXPECT_NE(msg.find("FabricOptions.tensor_parallel_size must be at least 1"), std::string::npos) << msg;
  o.tensor_parallel_size = 2;
  // A (replicate, shard, tp) mesh: consolidated checkpoints by default, a sharded one refused.
  o.fsdp.sharding = strategy::ShardingStrategy::HybridShard;
  EXPECT_EQ(resolve(o, 0).state_dict_type, strategy::StateDictType::Full);
  o.state_dict_type = strategy::StateDictType::Sharded;
  msg = tessera::testing::error_of([&] { resolve(o, 0); });
  EXPECT_NE(msg.find("state_dict_type Sharded with fsdp.sharding HybridShard and tensor_parallel_size=2"),
            std::string::npos)
      << msg;
  o.fsdp.sharding = strategy::ShardingStrategy::FullShard;
  o.state_dict_type = strategy::StateDictType::Full;
  EXPECT_EQ(resolve(o, 0).state_dict_type, strategy::StateDictType::Full);
}
