// Trainer example: the model, optimizer and loss live in a TrainingModule; the Trainer
// runs the loop, logs to CSV and keeps a last.ckpt to resume from.
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
  std::vector<fabric::OptimizerPtr> configure_optimizers() override {
    return {std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(lr))};
  }
  at::Tensor training_step(const trainer::Batch& batch, int64_t batch_idx) override {
    at::Tensor loss = (model().forward<at::Tensor>(batch.inputs) - batch.targets).pow(2).mean();
    log("batch_rows", static_cast<double>(batch.inputs.size(0)));
    return loss;  // the Trainer logs it (averaged over ranks) as train_loss
  }
  void on_train_epoch_end(int64_t epoch) override { fabric().print("epoch ", epoch, " done at step ", global_step()); }
  std::map<std::string, std::string> hparams() const override { return {{"lr", std::to_string(lr)}}; }
};

int main(int argc, char** argv) {
  trainer::TrainerOptions options;
  options.fabric.accelerator = "cpu";
  options.fabric.strategy = "ddp";
  options.fabric.devices = 2;
  options.max_steps = 30;
  options.batch_size = 16;  // per rank
  options.log_every_n_steps = 5;
  options.gradient_clip_val = 1.0;
  options.checkpoint_every_n_train_steps = 10;
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
  try {
    trainer::Trainer trainer(options);  // validates the options and launches the ranks

    // y = sin(x W) for a fixed random W: the same 512 samples on every rank.
    at::manual_seed(0);
    at::Tensor x = at::randn({512, 16});
    at::Tensor y = at::sin(x.matmul(at::randn({16, 4})));

    Regression module;
    trainer.fit(module, {x, y}, resume ? "last" : "");
    trainer.fabric().print("finished at step ", trainer.global_step(), "; logs in ", trainer.log_dir(),
                           "; checkpoint ", trainer.last_checkpoint_path());
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
