// DDP and the single-device strategy in one process: DDP's missing-gradient error names the
// parameter, find_unused_parameters leaves unused ones without a gradient, a strategy set up
// twice is an error. Multi-rank parity: test_strategy.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "support/test_util.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/strategy.h"

using namespace tessera;
using namespace tessera::strategy;
using tessera::testing::error_of;

namespace {

// `skip` is never used in forward.
struct UnusedImpl : torch::nn::Module {
  torch::nn::Linear used{nullptr}, skip{nullptr};
  UnusedImpl() {
    used = register_module("used", torch::nn::Linear(3, 2));
    skip = register_module("skip", torch::nn::Linear(3, 2));
  }
  at::Tensor forward(const at::Tensor& x) { return used(x); }
};
TORCH_MODULE(Unused);

}  // namespace

TEST(DdpLocal, MissingGradientNamesTheParameter) {
  DdpStrategy s(nullptr);
  auto m = s.setup(torch::nn::AnyModule(Unused()));
  const std::string msg = error_of([&] { s.backward(m.forward(at::randn({2, 3})).sum()); });
  EXPECT_NE(msg.find("'skip.weight'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("find_unused_parameters"), std::string::npos) << msg;
}

TEST(DdpLocal, UnusedParametersKeepNoGradient) {
  DdpOptions o;
  o.find_unused_parameters = true;
  DdpStrategy s(nullptr, o);
  Unused net;
  auto m = s.setup(torch::nn::AnyModule(net));
  s.backward(m.forward(at::randn({2, 3})).sum());
  EXPECT_TRUE(net->used->weight.grad().defined());
  EXPECT_FALSE(net->skip->weight.grad().defined());
}

TEST(StrategyLocal, SetupTwiceIsAnError) {
  SingleDeviceStrategy s;
  s.setup(torch::nn::AnyModule(torch::nn::Linear(2, 2)));
  EXPECT_THROW(s.setup(torch::nn::AnyModule(torch::nn::Linear(2, 2))), Error);
}
