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
#include "tessera/trainer/options.h"
#include "tessera/trainer/progress_bar.h"
#include "tessera/trainer/stage.h"
#include "tessera/trainer/training_module.h"

namespace tessera::trainer {

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
  // ckpt_path: "" (start fresh), a checkpoint path, "last" (the newest last
  // checkpoint of the ModelCheckpoint callbacks), or "auto": the newest checkpoint that
  // verifies in the ModelCheckpoint callbacks' directories (by stored global_step; a torn
  // or corrupted one is skipped with a message and left as it is), or a fresh start when
  // there is none; rank zero says which (checkpoint::find_resumable, which reads each
  // checkpoint it verifies once in full). A job restarted with the same "auto" continues
  // where it stopped. Returns callback_metrics(). One fit per Trainer.
  Metrics fit(TrainingModule& module, const TensorData& train, const TensorData& val = {},
              const std::string& ckpt_path = "");
  Metrics fit(TrainingModule& module, const TensorData& train, const std::string& ckpt_path) {
    return fit(module, train, TensorData{}, ckpt_path);
  }
  // One pass over `data` with validation_step / test_step; returns the averaged metrics.
  // Uses the module this Trainer fitted (or sets it up on first use); ckpt_path loads
  // model weights first ("last" and "auto" as in fit; "auto" finding none loads nothing).
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
  // Stage::Fit (its validation and sanity batches too), Stage::Validate, Stage::Test, or
  // Stage::None outside them.
  Stage stage() const { return stage_; }
  // Set by callbacks (EarlyStopping) to end fit after the current batch; must be set on
  // every rank alike.
  bool should_stop() const { return loop_.should_stop; }
  void set_should_stop(bool stop) { loop_.should_stop = stop; }
  // In Callback::on_train_batch_end: whether this batch ended with an optimizer step.
  bool optimizer_stepped() const { return loop_.optimizer_stepped; }
  // Training batches per epoch (after limit_train_batches) in the current fit.
  int64_t num_training_batches() const { return num_training_batches_; }
  // Whether the current fit validates (validation data given and limit_val_batches > 0).
  bool fit_has_validation() const { return loop_.has_validation; }
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
    Stage& stage;
    ~StageScope() {
      module->trainer_ = nullptr;
      stage = Stage::None;
    }
  };
  // What the Trainer has set up so far; each stage implies the ones before it (a
  // validate() sets up the model only, a later fit() adds the optimizers).
  enum class Setup { None, ConfiguringModel, Model, Optimizers };
  // Where the fit loop stands after a training batch; a checkpoint saved there records it
  // (as loop.val_pending / loop.epoch_end_done) so a resumed fit continues from that point.
  enum class LoopPosition {
    InEpoch,        // between training batches of an epoch, nothing due
    ValidationDue,  // a batch ended and its validation has not run yet
    EpochEnded,     // the epoch's end hooks ran; only the switch to the next epoch is left
  };
  // The state of one fit, reset as a whole when it starts (fit_loop.cpp).
  struct LoopState {
    LoopPosition position = LoopPosition::InEpoch;
    bool should_stop = false;        // a callback asked the fit to end after this batch
    bool optimizer_stepped = false;  // the current batch ended its accumulation group
    bool has_validation = false;     // validation data given and limit_val_batches > 0
  };
  struct EvalAcc {
    double sum = 0, weight = 0;
    bool sync = false, prog_bar = false;
  };
  // The fit loop's inputs and running sums (defined in fit_loop.cpp).
  struct FitContext;

  // trainer.cpp: the module, its model and optimizers, loggers, metrics, batches.
  void attach(TrainingModule& module);
  void setup_model(TrainingModule& module, bool with_optimizers);
  void setup_loggers(TrainingModule& module);
  void log_metric(const std::string& name, double value, bool prog_bar, bool sync_dist);
  void log_to_loggers(const Metrics& metrics, int64_t step);
  Batch make_batch(const TensorData& data, const std::vector<size_t>& idx) const;
  void step_schedulers(Interval interval);
  template <typename F>
  void each_callback(F&& f) {
    for (auto& c : callbacks_) f(*c);
  }
  // Tells every callback (ignoring their own errors) before the exception propagates.
  void notify_exception(TrainingModule& module, const std::exception& e);

  // fit_loop.cpp: the steps of fit.
  void prepare_fit(FitContext& fit, const std::string& ckpt_path);
  bool fit_done() const;
  void run_epoch(FitContext& fit);
  void start_epoch(FitContext& fit);
  void train_batch(FitContext& fit, const Batch& batch, int64_t batch_idx);
  void backward(FitContext& fit, const at::Tensor& loss, int64_t group, bool last);
  void optimizer_step(FitContext& fit, int64_t group);
  void clip_gradients();
  void show_train_progress(int64_t batch_idx);
  void validate_in_fit(FitContext& fit);
  void end_epoch(FitContext& fit);
  void finish_fit(FitContext& fit);

  // eval_loop.cpp: validation and test loops.
  int64_t eval_batches(const TensorData& data, const BatchCount& limit) const;
  Metrics evaluate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path, Stage stage);
  Metrics run_eval(TrainingModule& module, const TensorData& data, Stage stage, int64_t batches, bool sanity);
  void eval_start_hooks(TrainingModule& module, Stage stage);
  void eval_end_hooks(TrainingModule& module, Stage stage);
  Metrics eval_averages();

  // trainer_checkpoint.cpp: what a checkpoint holds and how it is restored.
  fabric::FabricState make_state();
  fabric::FabricState checkpoint_state(const std::string& path);
  void write_checkpoint(const std::string& path, bool async);
  std::string resolve_ckpt_path(const std::string& ckpt_path);  // "" for "auto" finding none
  std::string find_resumable_checkpoint();
  void load_checkpoint(const std::string& path, bool weights_only);
  void restore_loop(const std::string& path, const fabric::FabricState& st, const state::StateDict& rest);
  void restore_from_step(const std::string& path, const fabric::FabricState& st);
  void restore_schedulers(const std::string& path, const state::StateDict& rest);
  void restore_callbacks(const state::StateDict& rest);

  TrainerOptions options_;
  std::unique_ptr<fabric::Fabric> fabric_;
  std::vector<CallbackPtr> callbacks_;
  std::vector<LoggerPtr> loggers_;
  std::unique_ptr<ProgressBar> bar_;
  bool loggers_set_up_ = false;  // loggers are set up once, by the first stage run
  TrainingModule* module_ = nullptr;
  std::vector<fabric::OptimizerPtr> optimizers_;
  std::vector<SchedulerConfig> schedulers_;
  std::unique_ptr<fabric::DistributedSampler> sampler_;
  Metrics step_metrics_, callback_metrics_, logged_metrics_, progress_bar_metrics_;
  std::map<std::string, EvalAcc> eval_acc_;
  int64_t eval_rows_ = 0;
  bool in_eval_ = false;  // inside a validation or test loop: log() accumulates per batch
  Stage stage_ = Stage::None;
  int64_t global_step_ = 0, epoch_ = 0, num_training_batches_ = 0;
  bool fitted_ = false;  // one fit per Trainer
  LoopState loop_;
  std::string last_ckpt_;
  CheckpointStats ckpt_stats_;
  Setup setup_ = Setup::None;  // Setup::ConfiguringModel: inside configure_model (init_module is valid)
};

}  // namespace tessera::trainer
