// Module and optimizer state dicts: single-process behaviour, and with sharded
// tensors across real rank processes at world sizes 1..4.
#include <torch/torch.h>

#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"

using namespace tessera;
using tessera::testing::run_ranks;

using namespace tessera::testing;

namespace {

std::shared_ptr<distributed::Communicator> solo() { return distributed::Communicator::create(distributed::World{}); }

struct Block : torch::nn::Module {
  Block() {
    lin = register_module("lin", torch::nn::Linear(3, 3));
    norm = register_module("norm", torch::nn::BatchNorm1d(3));
  }
  torch::nn::Linear lin{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

struct Net : torch::nn::Module {
  Net() {
    a = register_module("a", std::make_shared<Block>());
    b = register_module("b", std::make_shared<Block>());
    head = register_module("head", torch::nn::Linear(3, 1));
  }
  at::Tensor forward(const at::Tensor& x) { return head(b->lin(a->lin(x).relu()).relu()); }
  std::shared_ptr<Block> a, b;
  torch::nn::Linear head{nullptr};
};



std::vector<at::Tensor> values(const torch::nn::Module& m) {
  std::vector<at::Tensor> v;
  for (auto& p : m.parameters()) v.push_back(p.detach().clone());
  for (auto& b : m.buffers()) v.push_back(b.detach().clone());
  return v;
}

bool same(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y) {
  if (x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i)
    if (!at::equal(x[i], y[i])) return false;
  return true;
}

}  // namespace

TEST(StateModule, FqnsOfNestedModulesParamsAndBuffers) {
  auto net = std::make_shared<Net>();
  auto sd = state::state_dict(*net);
  std::vector<std::string> want;
  for (const char* blk : {"a", "b"}) {
    for (const char* k : {"lin.weight", "lin.bias", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var",
                          "norm.num_batches_tracked"})
      want.push_back(std::string(blk) + "." + k);
  }
  want.push_back("head.weight");
  want.push_back("head.bias");
  EXPECT_EQ(sd.keys(), want);
  EXPECT_FALSE(sd.tensor("head.weight").requires_grad());
  EXPECT_EQ(sd.tensor("head.weight").data_ptr(), net->head->weight.data_ptr());
}

TEST(StateModule, StrictLoadReportsEverythingAndChangesNothing) {
  auto net = std::make_shared<Net>();
  auto saved = state::clone_state_dict(state::state_dict(*net));
  auto other = std::make_shared<Net>();
  EXPECT_FALSE(same(values(*net), values(*other)));
  EXPECT_TRUE(state::load_state_dict(*other, saved).ok());
  EXPECT_TRUE(same(values(*net), values(*other)));

  auto bad = state::clone_state_dict(saved);
  bad.erase("a.lin.bias");
  bad.erase("head.bias");
  bad.set("c.weight", torch::zeros({1}));
  bad.set("b.lin.weight", torch::zeros({3, 4}));
  bad.set("b.lin.bias", torch::zeros({3}, at::kDouble));
  bad.set("head.weight", int64_t{4});
  bad.set("a.lin.weight", torch::full({3, 3}, 9.0));
  auto fresh = std::make_shared<Net>();
  const auto before = values(*fresh);
  const std::string msg = error_of([&] { state::load_state_dict(*fresh, bad, true); });
  for (const char* part : {"2 missing key(s): a.lin.bias, head.bias", "1 unexpected key(s): c.weight",
                           "b.lin.weight: shape [3, 4] in the state dict, [3, 3] in the module",
                           "b.lin.bias: dtype Double in the state dict, Float in the module",
                           "head.weight: the state dict holds a int", "nothing was loaded"})
    EXPECT_CONTAINS(msg, part);
  EXPECT_TRUE(same(before, values(*fresh))) << "a failed strict load modified the module";

  auto rep = state::load_state_dict(*fresh, bad, false);
  EXPECT_EQ(rep.missing, (std::vector<std::string>{"a.lin.bias", "head.bias"}));
  EXPECT_EQ(rep.unexpected, (std::vector<std::string>{"c.weight"}));
  EXPECT_EQ(rep.mismatched.size(), 3u);
  EXPECT_FALSE(rep.ok());
  EXPECT_TRUE(at::equal(fresh->a->lin->weight, torch::full({3, 3}, 9.0)));
  EXPECT_TRUE(at::equal(fresh->a->norm->running_var, saved.tensor("a.norm.running_var")));
}

TEST(StateModule, RegistrationFollowsTheModuleLifetime) {
  auto c = solo();
  auto st = sharding::ShardedTensor::ones(sharding::ChunkSpec::over_ranks(0, 1), {4, 2}, at::kFloat, c);
  std::weak_ptr<torch::nn::Module> gone;
  {
    auto lin = std::make_shared<torch::nn::LinearImpl>(2, 2);
    state::register_sharded_tensor(*lin, "extra", st);
    EXPECT_TRUE(state::find_sharded_tensor(*lin, "extra").has_value());
    auto sd = state::state_dict(*lin);
    EXPECT_EQ(sd.keys(), (std::vector<std::string>{"weight", "bias", "extra"}));
    gone = lin;
  }
  EXPECT_TRUE(gone.expired());
  // A module at a reused address does not inherit the old registration.
  for (int i = 0; i < 8; ++i) {
    auto lin = std::make_shared<torch::nn::LinearImpl>(2, 2);
    EXPECT_FALSE(state::find_sharded_tensor(*lin, "extra").has_value());
  }
  // Stack module: explicit clear.
  {
    torch::nn::Module plain;
    state::register_sharded_tensor(plain, "t", st);
    EXPECT_EQ(state::named_sharded_tensors(plain).size(), 1u);
    EXPECT_TRUE(state::unregister_sharded_tensor(plain, "t"));
    EXPECT_FALSE(state::unregister_sharded_tensor(plain, "t"));
    state::clear_sharded_tensors(plain);
  }
  auto lin = std::make_shared<torch::nn::LinearImpl>(2, 2);
  EXPECT_CONTAINS(error_of([&] { state::register_sharded_tensor(*lin, "a.b", st); }), "contain no '.'");
  EXPECT_CONTAINS(error_of([&] { state::register_sharded_tensor(*lin, "weight", st); }),
                  "parameter of that name is not the sharded tensor's only local shard");
}

namespace {
// Creates `more` levels of children in configure_model.
struct Configurable : torch::nn::Module, state::ConfigurableModel {
  explicit Configurable(int more) : more(more) {}
  void configure_model(const std::shared_ptr<distributed::Communicator>& c) override {
    ++calls;
    if (more > 0) child = register_module("child", std::make_shared<Configurable>(more - 1));
  }
  std::shared_ptr<Configurable> child;
  int more, calls = 0;
};
}  // namespace

TEST(StateModule, ConfigureModelVisitsNewChildrenOnceAndIsIdempotent) {
  auto c = solo();
  auto root = std::make_shared<Configurable>(3);
  EXPECT_FALSE(root->model_configured());
  EXPECT_EQ(state::configure_model(*root, c), 4) << "children created by configure_model are configured too";
  EXPECT_EQ(state::configure_model(*root, c), 0);
  EXPECT_EQ(root->calls, 1);
  ASSERT_TRUE(root->child && root->child->child && root->child->child->child);
  EXPECT_EQ(root->child->child->child->calls, 1);
  EXPECT_TRUE(root->model_configured());
  // A module added later is configured by the next call, the others are not called again.
  root->child->child->child->register_module("late", std::make_shared<Configurable>(0));
  EXPECT_EQ(state::configure_model(*root, c), 1);
  EXPECT_EQ(root->calls, 1);
}

namespace {

void train(Net& net, torch::optim::Optimizer& opt, int from, int to, std::vector<float>* losses) {
  for (int s = from; s < to; ++s) {
    torch::manual_seed(100 + s);
    at::Tensor x = torch::randn({8, 3}), y = torch::randn({8, 1});
    opt.zero_grad();
    at::Tensor loss = (net.forward(x) - y).pow(2).mean();
    loss.backward();
    opt.step();
    if (losses) losses->push_back(loss.item<float>());
  }
}

template <typename Opt, typename Options>
void check_resume(const Options& options, const std::string& kind) {
  torch::manual_seed(1);
  auto a = std::make_shared<Net>();
  Opt oa(a->parameters(), options);
  train(*a, oa, 0, 3, nullptr);
  auto msd = state::clone_state_dict(state::state_dict(*a));
  auto osd = state::clone_state_dict(state::optimizer_state_dict(oa, *a));
  EXPECT_EQ(osd.string("optimizer"), kind);
  EXPECT_TRUE(osd.dict("state").contains("b.lin.weight")) << kind;
  EXPECT_EQ(osd.dict("param_groups").dict("0").dict("params").string("0"), "a.lin.weight");
  std::vector<float> straight, resumed;
  train(*a, oa, 3, 6, &straight);

  torch::manual_seed(2);
  auto b = std::make_shared<Net>();
  Options other = options;
  other.lr(options.lr() * 3);
  Opt ob(b->parameters(), other);
  train(*b, ob, 0, 1, nullptr);
  state::load_state_dict(*b, msd);
  state::load_optimizer_state_dict(ob, *b, osd);
  EXPECT_EQ(ob.param_groups()[0].options().get_lr(), options.lr());
  train(*b, ob, 3, 6, &resumed);
  EXPECT_EQ(straight, resumed) << kind << ": resuming from the state dicts changed the numbers";
}

}  // namespace

TEST(StateOptimizer, ResumeIsBitIdenticalForEverySupportedOptimizer) {
  check_resume<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true), "sgd");
  check_resume<torch::optim::Adam>(torch::optim::AdamOptions(0.01).amsgrad(true), "adam");
  check_resume<torch::optim::AdamW>(torch::optim::AdamWOptions(0.01), "adamw");
  check_resume<torch::optim::Adagrad>(torch::optim::AdagradOptions(0.1), "adagrad");
  check_resume<torch::optim::RMSprop>(torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true), "rmsprop");
}

TEST(StateOptimizer, MismatchesAreNamedAndNothingChanges) {
  auto net = std::make_shared<Net>();
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  train(*net, adam, 0, 1, nullptr);
  auto osd = state::clone_state_dict(state::optimizer_state_dict(adam, *net));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_CONTAINS(error_of([&] { state::load_optimizer_state_dict(sgd, *net, osd); }),
                  "for a adam optimizer, loading into a sgd optimizer");
  // Parameters in another order: named by FQN.
  auto params = net->parameters();
  std::swap(params[0], params[1]);
  torch::optim::Adam swapped(params, torch::optim::AdamOptions(0.5));
  EXPECT_CONTAINS(error_of([&] { state::load_optimizer_state_dict(swapped, *net, osd); }),
                  "param group 0 parameter 0 is 'a.lin.weight' in the state dict but 'a.lin.bias' in the optimizer");
  EXPECT_EQ(swapped.param_groups()[0].options().get_lr(), 0.5);
  // State for a parameter the optimizer does not hold.
  torch::optim::Adam part(std::vector<at::Tensor>{net->head->weight}, torch::optim::AdamOptions(0.5));
  auto one = state::clone_state_dict(osd);
  one.dict("param_groups").dict("0").set("params", std::make_shared<state::StateDict>());
  one.dict("param_groups").dict("0").dict("params").set("0", std::string("head.weight"));
  EXPECT_CONTAINS(error_of([&] { state::load_optimizer_state_dict(part, *net, one); }),
                  "has state for 'a.lin.weight', which is not a parameter of this optimizer");
  EXPECT_TRUE(part.state().empty());
  // A parameter the model does not own cannot be named.
  torch::optim::Adam stray(std::vector<at::Tensor>{torch::ones({2}, torch::requires_grad())}, torch::optim::AdamOptions());
  EXPECT_CONTAINS(error_of([&] { state::optimizer_state_dict(stray, *net); }), "is not a parameter of the model");
}

class StateRanks : public ::testing::TestWithParam<int> {};

TEST_P(StateRanks, NestedModulesWithShardedTensorsStrictAndNonStrict) {
  const int n = GetParam();
  auto res = run_ranks(n, {"module_state"});
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < n; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "module state ok rank " + std::to_string(r));
  }
}

TEST_P(StateRanks, OptimizerStateOfShardedParametersRoundTrips) {
  const int n = GetParam();
  for (const char* kind : {"adam", "sgd", "adamw"}) {
    if (n != 3 && std::string(kind) != "adam") continue;  // all kinds at 3 ranks, adam everywhere
    auto res = run_ranks(n, {"optimizer_state", kind});
    EXPECT_RANKS_OK(res) << kind;
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(res.out[r].empty()) << res.all_output();
      EXPECT_EQ(res.out[r].back(), "optimizer state ok rank " + std::to_string(r)) << kind;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, StateRanks, ::testing::Values(1, 2, 3, 4));
