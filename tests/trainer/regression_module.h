// The small regression TrainingModule the in-process Trainer tests train (scripted
// validation scores, optional LR scheduler, dropout), and what they read back from it.
#pragma once
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

#include "tessera/trainer/trainer.h"

namespace tessera::testing {

// Linear(3, 6) - Tanh - Dropout - Linear(6, 1) trained with SGD; counts its loop hooks.
struct Reg : trainer::TrainingModule {
  torch::nn::Sequential net;
  double lr = 0.1, momentum = 0.0, dropout = 0.0;
  std::string sched;           // "", "step", "epoch"
  std::vector<double> scores;  // scripted validation "score" per epoch
  int validations = 0, val_batches = 0, test_batches = 0, epoch_starts = 0;

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    net = torch::nn::Sequential(torch::nn::Linear(3, 6), torch::nn::Tanh(), torch::nn::Dropout(dropout),
                                torch::nn::Linear(6, 1));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
    if (sched == "step") return {opt, std::make_shared<trainer::StepLR>(opt, 2, 0.5)};
    if (sched == "epoch") return {opt, std::make_shared<trainer::LambdaLR>(opt, [](int64_t e) { return 1.0 / (1 + e); }),
                                trainer::Interval::Epoch};
    return opt;
  }
  at::Tensor mse(const trainer::Batch& b) { return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean(); }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override { return mse(b); }
  void validation_step(const trainer::Batch& b, int64_t) override {
    ++val_batches;
    if (!scores.empty()) log("score", scores.at(static_cast<size_t>(current_epoch())));
    else log("val_loss", mse(b), /*prog_bar=*/true, /*sync_dist=*/true);
  }
  void test_step(const trainer::Batch& b, int64_t) override {
    ++test_batches;
    log("test_loss", mse(b));
  }
  void on_validation_end() override { ++validations; }
  void on_train_epoch_start(int64_t) override { ++epoch_starts; }
};

// The mean squared error of the module's model over every sample of `d`.
inline double full_mse(Reg& m, const trainer::TensorData& d) {
  at::NoGradGuard ng;
  m.net->eval();
  const double v = (m.net->forward(d.inputs) - d.targets).pow(2).mean().item<double>();
  m.net->train();
  return v;
}

inline std::vector<at::Tensor> params_of(Reg& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace tessera::testing
