// Trainer: the high-level API over Fabric. The user writes a TrainingModule (model,
// optimizers, training_step); the Trainer runs the loop: distributed sampling, backward,
// clipping, optimizer steps, logging (CSV) and checkpoints (ModelCheckpoint save_last),
// with exact resume from a checkpoint, also mid-epoch.
//
//   struct Regression : trainer::TrainingModule {
//     torch::nn::Linear net{4, 1};
//     torch::nn::AnyModule configure_model() override { return torch::nn::AnyModule(net); }
//     std::vector<fabric::OptimizerPtr> configure_optimizers() override {
//       return {std::make_shared<torch::optim::SGD>(net->parameters(), 0.1)};
//     }
//     at::Tensor training_step(const trainer::Batch& b, int64_t) override {
//       return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
//     }
//   };
//   trainer::TrainerOptions o; o.max_steps = 100; o.fabric.strategy = "ddp"; o.fabric.devices = 2;
//   trainer::Trainer t(o);            // launches the ranks (see Fabric::launch)
//   Regression m;
//   t.fit(m, {x, y});                 // or t.fit(m, {x, y}, "last") to resume
//
// Limits of this version: no validation/test loops, callbacks other than the built-in
// ModelCheckpoint(save_last) or loggers other than CSV, no LR schedulers.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/fabric/fabric.h"
#include "tessera/trainer/csv_logger.h"

namespace tessera::trainer {

// A dataset of aligned tensors: sample i is (inputs[i], targets[i]).
struct TensorData {
  at::Tensor inputs, targets;
  int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
};

// One batch of this rank's samples.
struct Batch {
  at::Tensor inputs, targets;
  std::vector<size_t> indices;  // dataset indices of the rows
};

class Trainer;

class TrainingModule {
 public:
  virtual ~TrainingModule() = default;
  // Builds the model; called once per fit(), before configure_optimizers. A
  // torch::nn::Sequential can be returned as AnyModule(strategy::WrappedModule(seq)).
  virtual torch::nn::AnyModule configure_model() = 0;
  // Optimizers over the model's parameters (called after the model is set up).
  virtual std::vector<fabric::OptimizerPtr> configure_optimizers() = 0;
  // The loss of one batch (averaged over the batch). Forward through model().
  virtual at::Tensor training_step(const Batch& batch, int64_t batch_idx) = 0;

  virtual void on_fit_start() {}
  virtual void on_fit_end() {}
  virtual void on_train_epoch_start(int64_t epoch) {}
  virtual void on_train_epoch_end(int64_t epoch) {}
  // Extra state saved with / restored from checkpoints.
  virtual void on_save_checkpoint(state::StateDict& extra) {}
  virtual void on_load_checkpoint(const state::StateDict& extra) {}
  // Hyper-parameters written to hparams.yaml and saved in checkpoints.
  virtual std::map<std::string, std::string> hparams() const { return {}; }

  // The set-up model (valid from configure_optimizers on).
  torch::nn::AnyModule& model();
  // Logs a scalar at the current step (averaged over ranks when sync_dist). Collective
  // when sync_dist: every rank must log the same names in the same order.
  void log(const std::string& name, double value, bool sync_dist = false);
  fabric::Fabric& fabric();
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return epoch_; }

 private:
  friend class Trainer;
  Trainer* trainer_ = nullptr;
  torch::nn::AnyModule model_;
  int64_t global_step_ = 0, epoch_ = 0;
};

struct TrainerOptions {
  // Strategy, devices, precision... Trainer checkpoints default to Full (consolidated)
  // unless fabric.state_dict_type says otherwise.
  fabric::FabricOptions fabric;
  int64_t max_epochs = -1;  // -1: no limit (max_steps must be set then); default 1000 if both unset
  int64_t max_steps = -1;   // optimizer steps; -1: no limit
  int64_t batch_size = 32;  // per rank
  bool shuffle = true;
  uint64_t seed = 0;        // sampler seed
  std::optional<double> gradient_clip_val;  // global-norm clipping
  int64_t log_every_n_steps = 50;
  std::string default_root_dir = ".";  // logs and checkpoints below it
  bool enable_checkpointing = true;    // ModelCheckpoint(save_last): <root>/checkpoints/last.ckpt
  int64_t checkpoint_every_n_train_steps = 0;  // 0: only at the end of fit
  bool enable_logger = true;                   // CSV: <root>/lightning_logs/version_N/metrics.csv
};

class Trainer {
 public:
  // Validates the options and launches the ranks (Fabric::launch: when the program was
  // not started by a launcher and devices > 1, this re-runs it and never returns).
  explicit Trainer(TrainerOptions options);
  ~Trainer();

  // Trains until max_steps or max_epochs. ckpt_path: "" (start fresh), a checkpoint
  // path, or "last" (<root>/checkpoints/last.ckpt). Resume is exact: the sampler
  // position, step, epoch and optimizer state come from the checkpoint.
  void fit(TrainingModule& module, const TensorData& train, const std::string& ckpt_path = "");
  // Saves model, optimizers, loop state and the module's extra state (collective).
  void save_checkpoint(const std::string& path);

  fabric::Fabric& fabric() { return *fabric_; }
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return epoch_; }
  const std::string& last_checkpoint_path() const { return last_ckpt_; }
  // The run directory of the CSV logger ("" when disabled or before fit).
  std::string log_dir() const { return logger_ ? logger_->dir() : ""; }

 private:
  friend class TrainingModule;
  fabric::FabricState make_state(std::vector<fabric::OptimizerPtr>& opts);
  void log_metric(const std::string& name, double value, bool sync_dist);

  TrainerOptions options_;
  std::unique_ptr<fabric::Fabric> fabric_;
  std::unique_ptr<CsvLogger> logger_;
  TrainingModule* module_ = nullptr;
  std::vector<fabric::OptimizerPtr> optimizers_;
  std::unique_ptr<fabric::DistributedSampler> sampler_;
  std::map<std::string, double> pending_metrics_;
  int64_t global_step_ = 0, epoch_ = 0;
  std::string last_ckpt_;
  bool model_set_up_ = false;
};

}  // namespace tessera::trainer
