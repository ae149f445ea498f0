// FSDP in one process: wrapping keeps FQNs and values, tied parameters are refused by name,
// evaluation without backward leaves nothing gathered, a unit outside a strategy is plain,
// hybrid sharding's option checks. Its multi-rank parity, checkpoint and resume tests are
// in test_strategy.cpp (every strategy against the same single-process run).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/test_util.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::strategy;
using tessera::testing::error_of;

namespace {

struct TiedImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  at::Tensor shared;
  TiedImpl() {
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", torch::nn::Linear(4, 4));
    shared = register_parameter("shared", a->weight);  // tied: same tensor, second name
  }
  at::Tensor forward(const at::Tensor& x) { return b(a(x)); }
};
TORCH_MODULE(Tied);

}  // namespace

TEST(FsdpLocal, TiedParametersAreRefusedByName) {
  FsdpStrategy s(nullptr);
  const std::string msg = error_of([&] { s.setup(torch::nn::AnyModule(Tied())); });
  EXPECT_NE(msg.find("'a.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'shared'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tied"), std::string::npos) << msg;
}

TEST(FsdpLocal, WrappingKeepsFqnsAndValues) {
  at::manual_seed(1);
  torch::nn::Sequential plain(torch::nn::Linear(3, 5), torch::nn::Linear(5, 2));
  std::vector<std::string> names;
  for (auto& kv : plain->named_parameters()) names.push_back(kv.key());
  FsdpOptions o;
  o.auto_wrap = wrap_by_size(10);  // Linear(3,5) has 20, Linear(5,2) 12 elements
  FsdpStrategy s(nullptr, o);
  at::Tensor x = at::randn({4, 3});
  at::Tensor want = plain->forward(x);
  auto m = s.setup(plain);
  EXPECT_EQ(s.num_units(), 3);
  std::vector<std::string> got;
  for (auto& kv : s.module()->named_parameters()) got.push_back(kv.key());
  EXPECT_EQ(got, names);
  EXPECT_TRUE(at::allclose(m.forward(x), want));
  auto sd = s.module_state(StateDictType::Full);
  EXPECT_EQ(sd.keys(), names);
}

TEST(FsdpLocal, EvalWithoutGradLeavesNothingGathered) {
  FsdpOptions o;
  o.auto_wrap = wrap_all();
  o.mixed_precision.param_dtype = at::kBFloat16;  // forces gather/free even on one rank
  FsdpStrategy s(nullptr, o);
  auto m = s.setup(torch::nn::Sequential(torch::nn::Linear(3, 5), torch::nn::Linear(5, 2)));
  {
    at::NoGradGuard ng;
    at::Tensor y = m.forward(at::randn({2, 3}));
    EXPECT_EQ(y.scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(s.any_gathered());
  for (auto& p : s.module()->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
}

TEST(FsdpLocal, UnitOutsideAStrategyIsPlain) {
  at::manual_seed(2);
  torch::nn::Linear lin(3, 2);
  FsdpUnit u{torch::nn::AnyModule(lin)};
  at::Tensor x = at::randn({2, 3});
  EXPECT_TRUE(at::equal(u->forward(x), lin->forward(x)));
  EXPECT_EQ(u->named_parameters().keys(), lin->named_parameters().keys());
}

TEST(FsdpLocal, HybridNeedsADividingNodeSize) {
  FsdpOptions o;
  o.sharding = ShardingStrategy::HybridShard;
  o.ranks_per_node = 3;
  const std::string msg = error_of([&] { FsdpStrategy s(nullptr, o); });
  EXPECT_NE(msg.find("ranks_per_node 3"), std::string::npos) << msg;
}
