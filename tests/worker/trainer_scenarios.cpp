// Rank programs for the Trainer tests: fit on a small regression problem with a
// strategy, optionally resuming from the last checkpoint.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>

#include "scenario.h"
#include "tessera/core/env.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct Regression : trainer::TrainingModule {
  torch::nn::Sequential net;
  int64_t restored_marker = -1;

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(5);
    net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 2));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  std::vector<fabric::OptimizerPtr> configure_optimizers() override {
    return {std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.05))};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
  }
  void on_save_checkpoint(state::StateDict& extra) override { extra.set("marker", global_step() * 10); }
  void on_load_checkpoint(const state::StateDict& extra) override { restored_marker = extra.integer("marker"); }
  std::map<std::string, std::string> hparams() const override { return {{"lr", "0.05"}, {"model", "mlp 4-8-2"}}; }
};

trainer::TensorData make_data(int64_t n) {
  at::Tensor x = at::sin(at::arange(n * 4, at::kFloat).reshape({n, 4}) * 0.3);
  at::Tensor y = at::stack({x.sum(1), x.narrow(1, 0, 2).prod(1)}, 1);
  return {x, y};
}

}  // namespace

// trainer_fit STRATEGY ROOT MAX_STEPS [CKPT]: 20 samples, batch 3 per rank (mid-epoch
// stops and a partial last batch); prints "logdir <dir>" on rank 0.
SCENARIO("trainer_fit") {
  trainer::TrainerOptions o;
  o.fabric.accelerator = "cpu";
  o.fabric.strategy = args.arg(0);
  o.fabric.devices = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  o.fabric.comm.timeout = std::chrono::milliseconds(env::get_int("TESSERA_TEST_TIMEOUT_MS", 1).value_or(30000));
  o.default_root_dir = args.arg(1);
  o.max_steps = args.int_arg(2, 6);
  o.batch_size = 3;
  o.seed = 3;
  o.log_every_n_steps = 1;
  trainer::Trainer t(o);
  Regression m;
  t.fit(m, make_data(20), args.arg(3));
  if (!args.arg(3).empty()) WCHECK(m.restored_marker > 0, "on_load_checkpoint did not see the saved extra state");
  WCHECK(t.global_step() == o.max_steps, "stopped at step ", t.global_step());
  if (t.fabric().is_global_zero()) std::printf("logdir %s\n", t.log_dir().c_str());
  std::fflush(stdout);
  return 0;
}
