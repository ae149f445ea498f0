// Rank programs for the Trainer tests: fit on a small regression problem with a
// strategy, optionally resuming from a checkpoint (also at another world size), and a
// fit whose checkpoints and early stopping are driven by scripted, rank-dependent scores.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <filesystem>

#include "support/scenario.h"
#include "tessera/core/env.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct Regression : trainer::TrainingModule {
  torch::nn::Sequential net;
  int64_t restored_marker = -1;
  std::vector<double> scores;  // scripted validation score per epoch (rank 1 adds 100)
  double dropout = 0;          // > 0: a training step draws random numbers (RNG state must resume)

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(5);
    net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Dropout(dropout),
                                torch::nn::Linear(8, 2));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    auto opt = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.05));
    return {opt, std::make_shared<trainer::StepLR>(opt, 3, 0.5)};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
  }
  void validation_step(const trainer::Batch& b, int64_t) override {
    if (!scores.empty()) {
      log("score", scores.at(static_cast<size_t>(current_epoch())) + 100.0 * fabric().global_rank());
      return;
    }
    log("val_loss", (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean(), true, true);
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

trainer::TrainerOptions base_options(const std::string& strategy, const std::string& root) {
  trainer::TrainerOptions o;
  o.fabric.accelerator = "cpu";
  o.fabric.strategy = strategy;
  if (strategy == "fsdp-sharded") {  // the Trainer's FSDP checkpoints are Full unless asked
    o.fabric.strategy = "fsdp";
    o.fabric.state_dict_type = strategy::StateDictType::Sharded;
  }
  o.fabric.devices = static_cast<int>(env::get_int("WORLD_SIZE", 1).value_or(1));
  o.fabric.comm.timeout = std::chrono::milliseconds(env::get_int("TESSERA_TEST_TIMEOUT_MS", 1).value_or(30000));
  o.default_root_dir = root;
  o.seed = 3;
  o.log_every_n_steps = 1;
  o.enable_progress_bar = false;
  return o;
}

}  // namespace

// trainer_fit STRATEGY ROOT MAX_STEPS [CKPT|-] [BATCH=3] [ACCUMULATE=1] [SAMPLES=20]
// [DROPOUT=0]: CKPT a path, "last" or "auto"; batch BATCH per rank (20 samples at batch
// 3 on 2 ranks: mid-epoch stops and a partial last batch), validation on 8 samples every 2 batches, StepLR, LR monitor,
// optional dropout (the RNG states must resume too); prints "logdir <dir>" on rank 0 and
// "restored <marker>" (10 x the step of the checkpoint loaded, -1 when none) on every rank,
// or "fit error: <message>" when fit throws.
// STRATEGY "fsdp-sharded": FSDP with sharded checkpoints.
SCENARIO("trainer_fit") {
  trainer::TrainerOptions o = base_options(args.arg(0), args.arg(1));
  o.max_steps = args.int_arg(2, 6);
  const std::string ckpt = args.arg(3, "-") == "-" ? "" : args.arg(3);
  o.batch_size = args.int_arg(4, 3);
  o.accumulate_grad_batches = args.int_arg(5, 1);
  o.val_check_interval = 2;
  o.callbacks.push_back(std::make_shared<trainer::LearningRateMonitor>());
  trainer::Trainer t(o);
  Regression m;
  m.dropout = std::stod(args.arg(7, "0"));
  try {
    t.fit(m, make_data(args.int_arg(6, 20)), make_data(8), ckpt);
  } catch (const std::exception& e) {
    // Printed at once, before the Trainer is destroyed: the launcher stops the other
    // ranks as soon as one exits, and a test reads every rank's error.
    std::printf("fit error: %s\n", e.what());
    std::fflush(stdout);
    throw;
  }
  // "auto" may start fresh (marker -1): the tests read the "restored" line instead.
  if (!ckpt.empty() && ckpt != "auto") WCHECK(m.restored_marker > 0, "on_load_checkpoint did not see the saved extra state");
  WCHECK(t.global_step() == o.max_steps, "stopped at step ", t.global_step());
  std::printf("restored %lld\n", static_cast<long long>(m.restored_marker));
  if (t.fabric().is_global_zero()) std::printf("logdir %s\n", t.log_dir().c_str());
  std::fflush(stdout);
  return 0;
}

// trainer_topk STRATEGY ROOT EPOCHS [CKPT|-]: one training batch per epoch, validation
// logs a scripted "score" per epoch without sync_dist (rank 1's is 100 more, so only
// rank zero's may count); ModelCheckpoint keeps the best 2 (min) plus last, EarlyStopping
// (patience 2). Prints "kept <file>" for the top-k, "stopped <epoch> <step>" on every rank.
SCENARIO("trainer_topk") {
  trainer::TrainerOptions o = base_options(args.arg(0), args.arg(1));
  o.max_epochs = args.int_arg(2, 6);
  const std::string ckpt = args.arg(3, "-") == "-" ? "" : args.arg(3);
  o.batch_size = 4;
  o.limit_train_batches = 1;
  trainer::ModelCheckpointOptions mo;
  mo.monitor = "score";
  mo.save_top_k = 2;
  mo.save_last = true;
  mo.filename = "{epoch}-{score:.1f}";
  auto mc = std::make_shared<trainer::ModelCheckpoint>(mo);
  trainer::EarlyStoppingOptions eo;
  eo.monitor = "score";
  eo.patience = 2;
  auto es = std::make_shared<trainer::EarlyStopping>(eo);
  o.callbacks = {mc, es};
  trainer::Trainer t(o);
  Regression m;
  m.scores = {5, 3, 4, 1, 2, 6, 7, 8};  // best 1 at epoch 3; no improvement at 4, 5: stops after epoch 5
  t.fit(m, make_data(16), make_data(4), ckpt);
  for (auto& [p, s] : mc->best_k_models()) std::printf("kept %s %g\n", std::filesystem::path(p).filename().c_str(), s);
  std::printf("stopped %lld %lld\n", static_cast<long long>(es->stopped_epoch()), static_cast<long long>(t.global_step()));
  std::printf("best %s\n", std::filesystem::path(mc->best_model_path()).filename().c_str());
  std::fflush(stdout);
  return 0;
}
