// optim/adam.h: the one-pass Adam and AdamW follow libtorch's optimizers step for step
// (to float rounding), keep libtorch's state (so state dicts and checkpoints move between
// the two), take the tensor-operation path for what the loop does not cover, and give the
// same result whatever the number of threads.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tessera/optim/adam.h"
#include "tessera/state/optimizer_state.h"

namespace {

// A small model's worth of parameters (matrices, vectors, one larger than a thread's grain),
// the same values for every caller.
std::vector<at::Tensor> make_params(at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> ps;
  for (auto shape : std::vector<std::vector<int64_t>>{{64, 48}, {48}, {300, 700}, {7}, {1}})
    ps.push_back(torch::randn(shape, at::TensorOptions().dtype(dtype)).set_requires_grad(true));
  return ps;
}

// Gradients of step `k`: deterministic, of varied sign and scale, the same on both sides.
void set_grads(std::vector<at::Tensor>& ps, int k) {
  at::manual_seed(1000 + k);
  for (auto& p : ps) {
    at::NoGradGuard ng;
    p.mutable_grad() = torch::randn(p.sizes(), p.options()) * (1.0 + k % 3) + 0.1 * p.detach();
  }
}

std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> out;
  for (auto& p : ps) out.push_back(p.detach().clone().set_requires_grad(true));
  return out;
}

// The largest |a - b| / (|b| + 1) over all elements.
double max_rel_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const auto d = ((a[i].detach().to(at::kDouble) - b[i].detach().to(at::kDouble)).abs() /
                    (b[i].detach().to(at::kDouble).abs() + 1))
                       .max()
                       .item<double>();
    worst = std::max(worst, d);
  }
  return worst;
}

template <typename Ours, typename Theirs, typename Options>
double run_both(const Options& options, at::ScalarType dtype, int steps) {
  auto a = make_params(dtype, 7);
  auto b = clone_params(a);
  Ours ours(a, options);
  Theirs theirs(b, options);
  for (int k = 0; k < steps; ++k) {
    set_grads(a, k);
    set_grads(b, k);
    ours.step();
    theirs.step();
  }
  return max_rel_diff(a, b);
}

}  // namespace

TEST(OptimAdam, AdamWFollowsLibtorchStepForStep) {
  using O = torch::optim::AdamWOptions;
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "plain");
    const auto opts = O(2e-3).betas({0.9, 0.95}).weight_decay(0.01).eps(1e-8).amsgrad(amsgrad);
    EXPECT_LT((run_both<tessera::optim::AdamW, torch::optim::AdamW>(opts, at::kFloat, 25)), 2e-6);
    EXPECT_LT((run_both<tessera::optim::AdamW, torch::optim::AdamW>(opts, at::kDouble, 25)), 1e-13);
    EXPECT_LT((run_both<tessera::optim::AdamW, torch::optim::AdamW>(O(1e-2).weight_decay(0), at::kFloat, 10)), 2e-6);
  }
}

TEST(OptimAdam, AdamWithL2DecayFollowsLibtorchStepForStep) {
  using O = torch::optim::AdamOptions;
  for (bool amsgrad : {false, true}) {
    SCOPED_TRACE(amsgrad ? "amsgrad" : "plain");
    const auto opts = O(1e-3).betas({0.8, 0.99}).weight_decay(0.05).amsgrad(amsgrad);
    EXPECT_LT((run_both<tessera::optim::Adam, torch::optim::Adam>(opts, at::kFloat, 25)), 2e-6);
    EXPECT_LT((run_both<tessera::optim::Adam, torch::optim::Adam>(opts, at::kDouble, 25)), 1e-13);
    EXPECT_LT((run_both<tessera::optim::Adam, torch::optim::Adam>(O(1e-3), at::kFloat, 10)), 2e-6);
  }
}

TEST(OptimAdam, MovesTheParametersAsAdamWShould) {
  // Not only "like libtorch": a step moves every element (lr-sized first step against the
  // gradient's sign, since m / sqrt(v) = sign(g) after one step; eps too small to matter).
  auto ps = make_params(at::kFloat, 3);
  const auto before = clone_params(ps);
  tessera::optim::AdamW opt(ps, torch::optim::AdamWOptions(0.1).weight_decay(0).eps(1e-20));
  set_grads(ps, 0);
  opt.step();
  for (size_t i = 0; i < ps.size(); ++i) {
    const auto moved = before[i].detach() - ps[i].detach();
    EXPECT_TRUE(torch::allclose(moved, 0.1 * ps[i].grad().sign(), 1e-4, 1e-5)) << "parameter " << i;
  }
}

TEST(OptimAdam, OtherLayoutsAndDtypesTakeTheTensorPathWithTheSameResult) {
  // A transposed (non-contiguous) parameter and a bf16 one: not the one-pass loop's, still
  // libtorch's update.
  auto make = [] {
    at::manual_seed(11);
    return std::vector<at::Tensor>{torch::randn({40, 30}).t().set_requires_grad(true),
                                   torch::randn({33}, at::kBFloat16).set_requires_grad(true)};
  };
  auto a = make();
  auto b = make();
  ASSERT_FALSE(a[0].is_contiguous());
  const auto opts = torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
  tessera::optim::AdamW ours(a, opts);
  torch::optim::AdamW theirs(b, opts);
  for (int k = 0; k < 5; ++k) {
    set_grads(a, k);
    set_grads(b, k);
    ours.step();
    theirs.step();
  }
  EXPECT_TRUE(torch::equal(a[0], b[0]));
  EXPECT_TRUE(torch::equal(a[1], b[1]));
}

TEST(OptimAdam, SameResultWithOneThreadOrTwo) {
  const int threads = at::get_num_threads();
  auto run = [](int n) {
    at::set_num_threads(n);
    auto ps = make_params(at::kFloat, 5);
    tessera::optim::AdamW opt(ps, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    for (int k = 0; k < 3; ++k) {
      set_grads(ps, k);
      opt.step();
    }
    return ps;
  };
  const auto one = run(1);
  const auto two = run(2);
  at::set_num_threads(threads);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(torch::equal(one[i], two[i])) << "parameter " << i;
}

TEST(OptimAdam, StateMovesBetweenLibtorchsAdamWAndThisOne) {
  // Three steps with libtorch's AdamW, its state dict loaded into a one-pass AdamW, three
  // more steps there: the same as six steps of libtorch's (to float rounding), and the
  // state dicts name the same optimizer type and step.
  torch::nn::Linear model(16, 8);
  torch::nn::Linear twin(16, 8);
  {
    at::NoGradGuard ng;
    for (size_t i = 0; i < model->parameters().size(); ++i) twin->parameters()[i].copy_(model->parameters()[i]);
  }
  const auto opts = torch::optim::AdamWOptions(5e-3).weight_decay(0.02);
  torch::optim::AdamW reference(model->parameters(), opts);
  torch::optim::AdamW first(twin->parameters(), opts);
  auto grads = [](torch::nn::Linear& m, int k) {
    at::manual_seed(50 + k);
    m->zero_grad();
    m->forward(torch::randn({4, 16})).pow(2).sum().backward();
  };
  for (int k = 0; k < 3; ++k) {
    grads(model, k);
    reference.step();
    grads(twin, k);
    first.step();
  }
  const auto sd = tessera::state::optimizer_state_dict(first, *twin);
  tessera::optim::AdamW second(twin->parameters(), opts);
  tessera::state::load_optimizer_state_dict(second, *twin, sd);
  for (int k = 3; k < 6; ++k) {
    grads(model, k);
    reference.step();
    grads(twin, k);
    second.step();
  }
  EXPECT_LT(max_rel_diff(twin->parameters(), model->parameters()), 2e-6);
  const auto ours = tessera::state::optimizer_state_dict(second, *twin);
  const auto theirs = tessera::state::optimizer_state_dict(reference, *model);
  EXPECT_EQ(ours.string("optimizer"), "adamw");
  EXPECT_EQ(theirs.string("optimizer"), "adamw");
  const auto& weight = ours.dict("state").dict("weight");
  EXPECT_EQ(weight.keys(), theirs.dict("state").dict("weight").keys());
  EXPECT_EQ(weight.integer("step"), 6);
}

TEST(OptimAdam, AutogradSeesTheInPlaceUpdate) {
  // As with libtorch's in-place update: a graph that saved the parameter before the step
  // refuses to run backward after it, instead of using the changed values silently.
  for (bool ours : {true, false}) {
    SCOPED_TRACE(ours ? "tessera::optim::AdamW" : "torch::optim::AdamW");
    auto p = torch::randn({8}).set_requires_grad(true);
    auto y = (p * p).sum();  // saves p for backward
    p.mutable_grad() = torch::ones({8});
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (ours) opt = std::make_unique<tessera::optim::AdamW>(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(0.1));
    else opt = std::make_unique<torch::optim::AdamW>(std::vector<at::Tensor>{p}, torch::optim::AdamWOptions(0.1));
    const auto version = p._version();
    opt->step();
    EXPECT_GT(p._version(), version);
    EXPECT_THROW(y.backward(), c10::Error);
  }
}

TEST(OptimAdam, SparseGradientsAreRefusedByName) {
  auto p = torch::zeros({4, 3}).set_requires_grad(true);
  tessera::optim::AdamW opt({p}, torch::optim::AdamWOptions(1e-3));
  p.mutable_grad() = torch::eye(4).narrow(1, 0, 3).to_sparse();
  try {
    opt.step();
    FAIL() << "a sparse gradient was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("AdamW does not support sparse gradients"), std::string::npos) << e.what();
  }
}
