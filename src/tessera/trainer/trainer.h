// Trainer: the high-level API over Fabric. The user writes a TrainingModule (model,
// optimizers and LR schedulers, training/validation/test steps); the Trainer runs the
// loops: distributed sampling, gradient accumulation, backward, clipping, optimizer and
// scheduler steps, validation, callbacks (ModelCheckpoint, EarlyStopping,
// LearningRateMonitor, user callbacks), loggers (CSV, TensorBoard), the progress bar and
// checkpoints, with exact resume from a checkpoint (also mid-epoch, also at another
// world size when the data allows: see docs/trainer.md).
//
//   struct Regression : trainer::TrainingModule {
//     torch::nn::Linear net{4, 1};
//     torch::nn::AnyModule configure_model() override { return torch::nn::AnyModule(net); }
//     trainer::OptimizerConfig configure_optimizers() override {
//       auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
//       return {opt, std::make_shared<trainer::StepLR>(opt, 50, 0.5)};
//     }
//     at::Tensor training_step(const trainer::Batch& b, int64_t) override {
//       return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
//     }
//     void validation_step(const trainer::Batch& b, int64_t) override {
//       log("val_loss", (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean().item<double>(),
//           /*prog_bar=*/true, /*sync_dist=*/true);
//     }
//   };
//   trainer::TrainerOptions o; o.max_steps = 100; o.fabric.strategy = "ddp"; o.fabric.devices = 2;
//   trainer::Trainer t(o);            // launches the ranks (see Fabric::launch)
//   Regression m;
//   t.fit(m, {x, y}, {vx, vy});       // or t.fit(m, {x, y}, {vx, vy}, "last") to resume
//
// See docs/trainer.md for the complete example (examples/trainer_mlp/main.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/fabric/fabric.h"
#include "tessera/trainer/callback.h"
#include "tessera/trainer/logger.h"
#include "tessera/trainer/lr_scheduler.h"
#include "tessera/trainer/progress_bar.h"

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

// A number of batches (an integer) or a fraction of the available batches (a floating
// point value in [0, 1]): `o.limit_val_batches = 5;` or `o.limit_val_batches = 0.25;`.
struct BatchCount {
  BatchCount(int n) : batches(n) {}  // NOLINT(implicit)
  BatchCount(int64_t n) : batches(n) {}  // NOLINT(implicit)
  BatchCount(double f) : fraction(f) {}  // NOLINT(implicit)
  std::optional<int64_t> batches;
  std::optional<double> fraction;
  // How many of `available` batches (min(batches, available), or floor(fraction * available)
  // but at least 1 when fraction > 0).
  int64_t of(int64_t available) const;
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

struct TrainerOptions {
  // Strategy, devices, precision... Trainer checkpoints default to Full (consolidated)
  // unless fabric.state_dict_type says otherwise (Sharded: a directory per checkpoint).
  fabric::FabricOptions fabric;
  int64_t max_epochs = -1;  // -1: no limit (max_steps must be set then); default 1000 if both unset
  int64_t max_steps = -1;   // optimizer steps; -1: no limit
  int64_t batch_size = 32;  // per rank, per micro-batch
  int64_t eval_batch_size = 0;  // per rank for validation and test; 0: batch_size
  bool shuffle = true;      // training data only; validation / test data is never shuffled
  uint64_t seed = 0;        // sampler seed (epoch e uses seed + e)
  // Micro-batches per optimizer step; backward of all but the last runs without
  // gradient synchronization; each micro-batch's loss is divided by the number of
  // micro-batches in its step (so k micro-batches equal one batch k times larger).
  int64_t accumulate_grad_batches = 1;
  std::optional<double> gradient_clip_val;       // clip before every optimizer step
  std::string gradient_clip_algorithm = "norm";  // "norm" (global norm over every rank) or "value"
  // Validate every n training batches (integer) or after this fraction of the epoch's
  // batches (floating point, (0, 1]); counted within an epoch.
  BatchCount val_check_interval = 1.0;
  int64_t check_val_every_n_epoch = 1;  // validate in epochs e with (e + 1) % n == 0
  BatchCount limit_train_batches = 1.0, limit_val_batches = 1.0, limit_test_batches = 1.0;
  // Validation batches run before training starts (no metrics recorded, catches bugs in
  // validation_step early); 0 disables.
  int64_t num_sanity_val_steps = 0;
  // Deterministic algorithms (at::globalContext().setDeterministicAlgorithms).
  bool deterministic = false;
  int64_t log_every_n_steps = 50;
  std::string default_root_dir = ".";  // logs and checkpoints below it
  // Adds ModelCheckpoint(dirpath=<root>/checkpoints, save_last=true, save_top_k=0,
  // every_n_train_steps=checkpoint_every_n_train_steps) unless `callbacks` has a
  // ModelCheckpoint already.
  bool enable_checkpointing = true;
  int64_t checkpoint_every_n_train_steps = 0;
  // The default ModelCheckpoint writes in the background (ModelCheckpointOptions::async_save).
  bool checkpoint_async = false;
  std::vector<CallbackPtr> callbacks;
  // No loggers given and enable_logger: one CsvLogger(default_root_dir).
  bool enable_logger = true;
  std::vector<LoggerPtr> loggers;
  // Rank zero only.
  bool enable_progress_bar = true;
  ProgressBarOptions progress_bar;
};

class ModelCheckpoint;
class EarlyStopping;

class Trainer {
 public:
  // Validates the options (tessera::Error naming the option) and launches the ranks
  // (Fabric::launch: when the program was not started by a launcher and devices > 1,
  // this re-runs it and never returns).
  explicit Trainer(TrainerOptions options);
  ~Trainer();

  // Trains until max_steps, max_epochs or a callback's stop (EarlyStopping), validating
  // on `val` (when not empty) per val_check_interval / check_val_every_n_epoch.
  // ckpt_path: "" (start fresh), a checkpoint path, or "last" (the newest last
  // checkpoint of the ModelCheckpoint callbacks). Returns callback_metrics(). One fit per
  // Trainer.
  Metrics fit(TrainingModule& module, const TensorData& train, const TensorData& val = {},
              const std::string& ckpt_path = "");
  Metrics fit(TrainingModule& module, const TensorData& train, const std::string& ckpt_path) {
    return fit(module, train, TensorData{}, ckpt_path);
  }
  // One pass over `data` with validation_step / test_step; returns the averaged metrics.
  // Uses the module this Trainer fitted (or sets it up on first use); ckpt_path loads
  // model weights first ("last" as in fit).
  Metrics validate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path = "");
  Metrics test(TrainingModule& module, const TensorData& data, const std::string& ckpt_path = "");
  // Saves model, optimizers, schedulers, loop and sampler state, RNG states, callback
  // states, hparams and the module's extra state (collective).
  void save_checkpoint(const std::string& path);
  // The same checkpoint written in the background (Fabric::save_async): returns once
  // every rank has copied its state to host memory; training goes on while the files
  // are written. At most one save is in flight: a later save (or a load, or the end of
  // fit) waits for it, and its error is raised there. Callbacks'
  // on_save_checkpoint runs when the state has been copied, before the commit.
  void save_checkpoint_async(const std::string& path);
  // Blocks until the async save in flight (if any) is committed; rethrows its error.
  void wait_for_checkpoint();
  struct CheckpointStats {
    int64_t saves = 0;                  // save_checkpoint and save_checkpoint_async calls
    double blocking_seconds = 0;        // time the training loop spent in them
    double first_blocking_seconds = 0;  // of which the first save's (an async one also
                                        // creates the background process group)
  };
  const CheckpointStats& checkpoint_stats() const { return ckpt_stats_; }

  fabric::Fabric& fabric() { return *fabric_; }
  const TrainerOptions& options() const { return options_; }
  int64_t global_step() const { return global_step_; }
  int64_t current_epoch() const { return epoch_; }
  bool is_global_zero() const { return fabric_->is_global_zero(); }
  int world_size() const { return fabric_->world_size(); }
  // "fit", "validate", "test" or "" (outside them); "sanity_check" during sanity batches.
  const std::string& stage() const { return stage_; }
  // Set by callbacks (EarlyStopping) to end fit after the current batch; must be set on
  // every rank alike.
  bool should_stop() const { return should_stop_; }
  void set_should_stop(bool stop) { should_stop_ = stop; }
  // In Callback::on_train_batch_end: whether this batch ended with an optimizer step.
  bool optimizer_stepped() const { return optimizer_stepped_; }
  // Training batches per epoch (after limit_train_batches) in the current fit.
  int64_t num_training_batches() const { return num_training_batches_; }
  // Whether the current fit validates (validation data given and limit_val_batches > 0).
  bool fit_has_validation() const { return has_val_; }
  // callback_metrics() as global rank zero has them (collective when world_size > 1):
  // what callbacks base decisions on so that every rank decides alike.
  Metrics rank_zero_metrics();

  // The latest value of every metric logged (train_loss, validation averages, ...).
  const Metrics& callback_metrics() const { return callback_metrics_; }
  // The metrics given to the loggers at the last logging call.
  const Metrics& logged_metrics() const { return logged_metrics_; }
  const Metrics& progress_bar_metrics() const { return progress_bar_metrics_; }

  const std::vector<CallbackPtr>& callbacks() const { return callbacks_; }
  const std::vector<LoggerPtr>& loggers() const { return loggers_; }
  // The first ModelCheckpoint / EarlyStopping among callbacks() (nullptr when none).
  std::shared_ptr<ModelCheckpoint> checkpoint_callback() const;
  std::shared_ptr<EarlyStopping> early_stopping_callback() const;
  const std::vector<fabric::OptimizerPtr>& optimizers() const { return optimizers_; }
  const std::vector<SchedulerConfig>& lr_schedulers() const { return schedulers_; }
  // The path of the last checkpoint written by save_last ("" when none yet).
  const std::string& last_checkpoint_path() const { return last_ckpt_; }
  void set_last_checkpoint_path(const std::string& path) { last_ckpt_ = path; }
  // The first logger's run directory ("" without loggers or before fit/validate/test).
  std::string log_dir() const;

 private:
  friend class TrainingModule;
  // While fit/validate/test runs: detaches the module and clears the stage when it ends,
  // however it ends.
  struct StageScope {
    TrainingModule* module;
    std::string& stage;
    ~StageScope() {
      module->trainer_ = nullptr;
      stage.clear();
    }
  };
  struct EvalAcc {
    double sum = 0, weight = 0;
    bool sync = false, prog_bar = false;
  };
  void attach(TrainingModule& module);
  void setup_model(TrainingModule& module, bool with_optimizers);
  void setup_loggers(TrainingModule& module);
  fabric::FabricState make_state();
  fabric::FabricState checkpoint_state(const std::string& path);
  void write_checkpoint(const std::string& path, bool async);
  void load_checkpoint(const std::string& path, bool weights_only);
  std::string resolve_ckpt_path(const std::string& ckpt_path);
  void log_metric(const std::string& name, double value, bool prog_bar, bool sync_dist);
  void log_to_loggers(const Metrics& metrics, int64_t step);
  int64_t eval_batches(const TensorData& data, const BatchCount& limit) const;
  Metrics run_eval(TrainingModule& module, const TensorData& data, const std::string& stage, int64_t batches,
                   bool sanity);
  Metrics evaluate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path,
                   const std::string& stage);
  Batch make_batch(const TensorData& data, const std::vector<size_t>& idx) const;
  void step_schedulers(const std::string& interval);
  template <typename F>
  void each_callback(F&& f);

  TrainerOptions options_;
  std::unique_ptr<fabric::Fabric> fabric_;
  std::vector<CallbackPtr> callbacks_;
  std::vector<LoggerPtr> loggers_;
  std::unique_ptr<ProgressBar> bar_;
  bool loggers_set_up_ = false;
  TrainingModule* module_ = nullptr;
  std::vector<fabric::OptimizerPtr> optimizers_;
  std::vector<SchedulerConfig> schedulers_;
  std::unique_ptr<fabric::DistributedSampler> sampler_;
  Metrics step_metrics_, callback_metrics_, logged_metrics_, progress_bar_metrics_;
  std::map<std::string, EvalAcc> eval_acc_;
  int64_t eval_rows_ = 0;
  bool in_eval_ = false;
  std::string stage_;
  int64_t global_step_ = 0, epoch_ = 0, num_training_batches_ = 0;
  bool should_stop_ = false, optimizer_stepped_ = false, fitted_ = false, has_val_ = false;
  // Loop state saved in checkpoints: the epoch's end hooks already ran (only the switch
  // to the next epoch is left); the batch's validation has not run yet.
  bool epoch_end_done_ = false, val_pending_ = false;
  std::string last_ckpt_;
  CheckpointStats ckpt_stats_;
  bool model_set_up_ = false, optimizers_set_up_ = false;
  bool configuring_model_ = false;  // inside TrainingModule::configure_model (init_module is valid)
};

}  // namespace tessera::trainer
