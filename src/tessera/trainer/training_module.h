// TrainingModule: what the user writes for the Trainer (the model, its optimizers and LR
// schedulers, the training / validation / test steps, hooks, extra checkpoint state and
// metric logging), with the data types its steps see: TensorData (a dataset of aligned
// tensors) and Batch (one batch of a rank's samples).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tessera/state/state_dict.h"
#include "tessera/trainer/lr_scheduler.h"

namespace tessera::fabric {
class Fabric;
}

namespace tessera::trainer {

using Metrics = std::map<std::string, double>;

// A dataset of aligned tensors: sample i is (inputs[i], targets[i]).
struct TensorData {
  at::Tensor inputs, targets;
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
  bool empty() const { return size() == 0; }
};

// One batch of this rank's samples.
struct Batch {
  at::Tensor inputs, targets;
  std::vector<size_t> indices;  // dataset indices of the rows
  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

class Trainer;

class TrainingModule {
 public:
  virtual ~TrainingModule() = default;
  // Builds the model; called once per Trainer (the first fit/validate/test), before
  // configure_optimizers. A torch::nn::Sequential can be returned as
  // AnyModule(strategy::WrappedModule(seq)). Build large pieces (transformer blocks)
  // through init_module() so FSDP shards each one as soon as it exists.
  virtual torch::nn::AnyModule configure_model() = 0;
  // Optimizers over the model's parameters (called after the model is set up), with
  // optional LR schedulers. Returning one optimizer or a vector of them converts.
  virtual OptimizerConfig configure_optimizers() = 0;
  // The loss of one batch (averaged over the batch). Forward through model().
  virtual at::Tensor training_step(const Batch& batch, int64_t batch_idx) = 0;
  // Called for every validation / test batch (model in eval mode, no autograd); report
  // with log(). The defaults throw: giving validation (test) data without overriding
  // validation_step (test_step) is an error.
  virtual void validation_step(const Batch& batch, int64_t batch_idx);
  virtual void test_step(const Batch& batch, int64_t batch_idx);

  // Hooks (every rank).
  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_start() {}
  virtual void on_train_end() {}
  virtual void on_train_epoch_start(int64_t epoch) {}
  virtual void on_train_epoch_end(int64_t epoch) {}
  virtual void on_train_batch_start(const Batch& batch, int64_t batch_idx) {}
  virtual void on_train_batch_end(const at::Tensor& loss, const Batch& batch, int64_t batch_idx) {}
  virtual void on_before_backward(const at::Tensor& loss) {}
  virtual void on_after_backward() {}
  virtual void on_before_optimizer_step(torch::optim::Optimizer& optimizer) {}
  virtual void on_before_zero_grad(torch::optim::Optimizer& optimizer) {}
  virtual void on_validation_start() {}
  virtual void on_validation_end() {}
  virtual void on_validation_epoch_start() {}
  virtual void on_validation_epoch_end() {}
  virtual void on_test_start() {}
  virtual void on_test_end() {}
  // Extra state saved with / restored from checkpoints (plain values).
  virtual void on_save_checkpoint(state::StateDict& extra) {}
  virtual void on_load_checkpoint(const state::StateDict& extra) {}
  // Hyper-parameters written by the loggers (hparams.yaml) and saved in checkpoints.
  virtual std::map<std::string, std::string> hparams() const { return {}; }

  // The set-up model (valid from configure_optimizers on).
  torch::nn::AnyModule& model();
  // Logs a scalar. In training: a metric of the current step (the value of the last
  // micro-batch when accumulating), written by the loggers every log_every_n_steps. In
  // validation / test: averaged over the loop's samples (weighted by batch size) and
  // recorded at the current global step when the loop ends. prog_bar: shown by the
  // progress bar. sync_dist: averaged over ranks too (in training immediately, a
  // collective; in validation / test once at the end of the loop) — every rank must
  // then log the same names. Every logged value is in Trainer::callback_metrics().
  void log(const std::string& name, double value, bool prog_bar = false, bool sync_dist = false);
  void log(const std::string& name, const at::Tensor& value, bool prog_bar = false, bool sync_dist = false);
  void log_dict(const Metrics& metrics, bool prog_bar = false, bool sync_dist = false);
  fabric::Fabric& fabric();
  Trainer& trainer();
  // The strategy's module-init context, for configure_model(): builds one piece of the
  // model and returns it ready to register. FSDP shards the piece's parameters at once
  // (it becomes an FSDP unit), so a model larger than one rank's memory is never
  // materialized whole; the other strategies return the piece as built. Only valid
  // inside configure_model().
  torch::nn::AnyModule init_module(const std::function<torch::nn::AnyModule()>& build);
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return epoch_; }

 private:
  friend class Trainer;
  Trainer* trainer_ = nullptr;
  torch::nn::AnyModule model_;
  int64_t global_step_ = 0, epoch_ = 0;
};

}  // namespace tessera::trainer
