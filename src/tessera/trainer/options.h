// TrainerOptions: what a Trainer runs (epochs, steps, batch sizes, accumulation,
// clipping, validation cadence, checkpointing, callbacks, loggers, progress bar), and
// BatchCount, the "n batches or a fraction of them" the limits and the validation
// interval are given in. Trainer's constructor checks them (tessera::Error naming the
// option).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/fabric/options.h"
#include "tessera/trainer/callback.h"
#include "tessera/trainer/logger.h"
#include "tessera/trainer/progress_bar.h"

namespace tessera::trainer {

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

}  // namespace tessera::trainer
