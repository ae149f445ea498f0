// Trainer example: the model, optimizer, LR schedule and the training / validation steps
// live in a TrainingModule; the Trainer runs the loops, validates twice per epoch, keeps
// the best two checkpoints by val_loss plus last.ckpt, stops early when val_loss stalls,
// logs to CSV (with the learning rate) and resumes exactly from last.ckpt.
//
//   ./trainer_mlp --devices 2 --strategy ddp --steps 30 --root /tmp/mlp-run
//   ./trainer_mlp --devices 2 --strategy ddp --steps 60 --root /tmp/mlp-run --resume
//
// Started without a launcher, the Trainer re-runs the program on `devices` ranks.
#include <ATen/ATen.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <iostream>
#include <string>

#include "tessera/core/blas.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;

struct Regression : trainer::TrainingModule {
  double lr = 3e-3;
  torch::nn::Sequential net;

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(42);  // same initial weights on every rank
    net = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 4));
    return torch::nn::AnyModule(strategy::WrappedModule(net));  // a Sequential goes in through WrappedModule
  }
  trainer::OptimizerConfig configure_optimizers() override {
    auto opt = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(lr));
    // Linear warmup over 5 steps, then cosine decay to 10% of lr at step 100 (stepped per optimizer step).
    return {opt, std::make_shared<trainer::WarmupCosineLR>(opt, 5, 100, 0.1)};
  }
  at::Tensor loss(const trainer::Batch& batch) {
    return (model().forward<at::Tensor>(batch.inputs) - batch.targets).pow(2).mean();
  }
  at::Tensor training_step(const trainer::Batch& batch, int64_t batch_idx) override {
    log("batch_rows", static_cast<double>(batch.inputs.size(0)));
    return loss(batch);  // the Trainer logs it (averaged over ranks) as train_loss
  }
  void validation_step(const trainer::Batch& batch, int64_t batch_idx) override {
    // Averaged over the validation samples of every rank, shown by the progress bar.
    log("val_loss", loss(batch), /*prog_bar=*/true, /*sync_dist=*/true);
  }
  void on_train_epoch_end(int64_t epoch) override { fabric().print("epoch ", epoch, " done at step ", global_step()); }
  std::map<std::string, std::string> hparams() const override { return {{"lr", std::to_string(lr)}}; }
};

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

int main(int argc, char** argv) {
  trainer::TrainerOptions options;
  options.fabric.accelerator = "cpu";
  options.fabric.strategy = "ddp";
  options.fabric.devices = 2;
  options.max_steps = 30;
  options.batch_size = 16;         // per rank
  options.val_check_interval = 0.5;  // validate twice per epoch
  options.log_every_n_steps = 5;
  options.gradient_clip_val = 1.0;
  bool resume = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (k == "--devices") options.fabric.devices = std::stoi(value());
    else if (k == "--strategy") options.fabric.strategy = value();
    else if (k == "--steps") options.max_steps = std::stoll(value());
    else if (k == "--root") options.default_root_dir = value();
    else if (k == "--resume") resume = true;
    else {
      std::cerr << "unknown option " << k << "\n";
      return 2;
    }
  }
  // <root>/checkpoints: the best two by val_loss (e.g. "epoch=1-step=24-val_loss=0.1234.ckpt"),
  // checked every 10 steps, and last.ckpt.
  trainer::ModelCheckpointOptions best;
  best.monitor = "val_loss";
  best.save_top_k = 2;
  best.save_last = true;
  best.every_n_train_steps = 10;
  best.filename = "{epoch}-{step}-{val_loss:.4f}";
  trainer::EarlyStoppingOptions stop;
  stop.monitor = "val_loss";
  stop.patience = 5;  // validations without improvement
  options.callbacks = {std::make_shared<trainer::ModelCheckpoint>(best), std::make_shared<trainer::EarlyStopping>(stop),
                       std::make_shared<trainer::LearningRateMonitor>()};  // logs "lr-AdamW"
  try {
    trainer::Trainer trainer(options);  // validates the options and launches the ranks

    // y = sin(x W) for a fixed random W: the same 512 + 128 samples on every rank.
    at::manual_seed(0);
    at::Tensor w = at::randn({16, 4});
    at::Tensor x = at::randn({512, 16}), vx = at::randn({128, 16});
    trainer::TensorData train{x, at::sin(x.matmul(w))}, val{vx, at::sin(vx.matmul(w))};

    Regression module;
    trainer.fit(module, train, val, resume ? "last" : "");
    trainer.fabric().print("finished at step ", trainer.global_step(), "; logs in ", trainer.log_dir(),
                           "; best checkpoint ", trainer.checkpoint_callback()->best_model_path());
    trainer::Metrics m = trainer.validate(module, val);
    trainer.fabric().print("val_loss ", m.at("val_loss"));
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
