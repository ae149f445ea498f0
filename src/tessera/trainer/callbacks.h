// Built-in Trainer callbacks: ModelCheckpoint, EarlyStopping, LearningRateMonitor.
// Their decisions are taken from values every rank agrees on (monitored metrics are
// taken from global rank zero), so every rank saves, removes and stops together.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/trainer/callback.h"
#include "tessera/trainer/trainer.h"

namespace tessera::trainer {

struct ModelCheckpointOptions {
  std::string dirpath;  // "": <default_root_dir>/checkpoints
  // Template of the file name (".ckpt" is appended): "{name}" or "{name:fmt}" is
  // replaced by the metric's value ("epoch", "step" and every callback metric), with
  // fmt one of ".Nf", ".Ne", ".Ng", "d"; with auto_insert_metric_name, "{name}" becomes
  // "name=<value>". Default "{epoch}-{step}". A name already used by another file
  // gets "-v1", "-v2"...
  std::string filename;
  bool auto_insert_metric_name = true;
  std::string monitor;        // "": no metric (save_top_k 1 keeps the newest, -1 all)
  std::string mode = "min";   // "min" or "max"
  int64_t save_top_k = 1;     // 0: none, k: the best k (by monitor), -1: all
  bool save_last = false;     // also (re)write "last.ckpt" at every save
  int64_t every_n_train_steps = 0;  // > 0: save after every n optimizer steps
  // When every_n_train_steps is 0: save after validation in epochs e with (e + 1) % n == 0
  // (after the training epoch when the fit has no validation); 0 disables.
  int64_t every_n_epochs = 1;
  // Write in the background (Trainer::save_checkpoint_async): training goes on while the
  // files are written; checkpoints this one supersedes are removed once it is committed
  // (at the next save or the end of training). A save_last right after a top-k save of
  // the same step waits for that one.
  bool async_save = false;
};

// Saves checkpoints during fit, keeps the best save_top_k of them (removing superseded
// files and sharded checkpoint directories) and optionally last.ckpt. Its bookkeeping
// (best_k_models, best/last paths) is in its checkpointed state, so a resumed fit keeps
// ranking against (and removing) the checkpoints of the earlier run. Always saves
// last.ckpt at the end of fit when save_last.
class ModelCheckpoint : public Callback {
 public:
  // Throws tessera::Error naming the option (ModelCheckpoint.mode, .save_top_k, ...).
  explicit ModelCheckpoint(ModelCheckpointOptions options = {});

  std::string state_key() const override;
  state::StateDict state_dict() const override;
  void load_state_dict(const state::StateDict& state) override;
  void setup(Trainer& trainer, TrainingModule& module, Stage stage) override;
  // With async_save: creates the async saves' background communicator now
  // (checkpoint::prepare_async_save), not inside the first save.
  void on_fit_start(Trainer& trainer, TrainingModule& module) override;
  void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss, const Batch& batch,
                          int64_t batch_idx) override;
  void on_validation_end(Trainer& trainer, TrainingModule& module) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module) override;
  void on_train_end(Trainer& trainer, TrainingModule& module) override;

  const ModelCheckpointOptions& options() const { return o_; }
  const std::string& dirpath() const { return dirpath_; }
  // path -> score of the kept top-k checkpoints (monitor set), or the kept checkpoints
  // with their global step as score (no monitor).
  const std::map<std::string, double>& best_k_models() const { return best_k_; }
  const std::string& best_model_path() const { return best_path_; }
  std::optional<double> best_model_score() const { return best_score_; }
  const std::string& last_model_path() const { return last_path_; }
  // The file name (without directory) the template gives for these metrics.
  std::string format_name(const Metrics& metrics) const;
  std::string last_path() const { return dirpath_ + "/last.ckpt"; }

 private:
  void save(Trainer& trainer, TrainingModule& module);
  void save_last(Trainer& trainer);
  bool better(double a, double b) const;
  std::string unique_path(Trainer& trainer, const std::string& stem, const std::string& replaces);
  void remove(Trainer& trainer, const std::string& path);
  // A checkpoint superseded by the one just saved: removed now, or (async_save) once
  // that one is committed.
  void retire(Trainer& trainer, const std::string& path);
  // Saves `path` (sync or async per the options).
  void write(Trainer& trainer, const std::string& path);
  // Removes superseded checkpoints whose replacement is committed (waits for it).
  void flush_removals(Trainer& trainer);

  ModelCheckpointOptions o_;
  std::string dirpath_;
  std::map<std::string, double> best_k_;
  std::string best_path_, last_path_, kth_path_;
  std::optional<double> best_score_;
  int64_t last_saved_step_ = -1, last_saved_last_step_ = -1;
  bool fit_has_val_ = false, warned_missing_ = false;
  std::vector<std::string> pending_removals_;  // superseded by an async save in flight
};

struct EarlyStoppingOptions {
  std::string monitor = "val_loss";
  std::string mode = "min";  // "min" or "max"
  int64_t patience = 3;      // checks without improvement before stopping
  double min_delta = 0.0;    // an improvement must beat the best by more than this
  bool check_finite = true;  // stop at once when the monitored value is NaN or infinite
  // Monitored metric absent when checked: error (strict) or skip the check.
  bool strict = true;
  // Check after the training epoch instead of after validation (the default when the
  // fit has no validation data).
  std::optional<bool> check_on_train_epoch_end;
};

// Stops fit when the monitored metric has not improved for `patience` checks (one check
// after every validation, or every training epoch). All ranks stop at the same batch.
class EarlyStopping : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options = {});
  std::string state_key() const override;
  state::StateDict state_dict() const override;
  void load_state_dict(const state::StateDict& state) override;
  void setup(Trainer& trainer, TrainingModule& module, Stage stage) override;
  void on_validation_end(Trainer& trainer, TrainingModule& module) override;
  void on_train_epoch_end(Trainer& trainer, TrainingModule& module) override;

  int64_t wait_count() const { return wait_; }
  std::optional<double> best_score() const { return best_; }
  int64_t stopped_epoch() const { return stopped_epoch_; }  // -1: did not stop
  int64_t stopped_step() const { return stopped_step_; }
  const std::string& reason() const { return reason_; }

 private:
  void check(Trainer& trainer);
  EarlyStoppingOptions o_;
  std::optional<double> best_;
  int64_t wait_ = 0, stopped_epoch_ = -1, stopped_step_ = -1;
  bool on_train_epoch_end_ = false;
  std::string reason_;
};

// Logs the learning rate of every param group of every optimizer at each training batch
// that starts an optimizer step: "lr-<name>" (one group) or "lr-<name>/pg<i>" (several),
// where name is the SchedulerConfig's name or the optimizer's class ("SGD", "Adam",
// "AdamW", ...; "-<i>" appended when two optimizers share it).
class LearningRateMonitor : public Callback {
 public:
  LearningRateMonitor() = default;
  void on_train_batch_start(Trainer& trainer, TrainingModule& module, const Batch& batch, int64_t batch_idx) override;
  // The keys of the values logged for `trainer`'s optimizers.
  static std::vector<std::string> keys(const Trainer& trainer);

 private:
  int64_t last_step_ = -1;
};

}  // namespace tessera::trainer
