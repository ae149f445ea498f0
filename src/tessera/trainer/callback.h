// The Trainer's callback interface. A Callback sees the Trainer and the module at every
// stage of fit / validate / test; every hook runs on every rank (hooks may call
// collectives, in the same order on every rank). Built-in callbacks (ModelCheckpoint,
// EarlyStopping, LearningRateMonitor) are in callbacks.h.
//
// State: state_dict() is saved in every checkpoint under "callbacks.<state_key()>" and
// given back to load_state_dict() when a fit resumes from it. It must be flat (plain
// values: int, float, bool, string, small tensors) and the same on every rank.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>

#include "tessera/state/state_dict.h"
#include "tessera/trainer/stage.h"

namespace tessera::trainer {

class Trainer;
class TrainingModule;
struct Batch;

class Callback {
 public:
  virtual ~Callback() = default;

  // Identifies the callback's state in checkpoints: unique among a Trainer's callbacks
  // that have state, no '.'. Default "": no state (a non-empty state_dict() under an
  // empty key is an error naming the callback's position in TrainerOptions.callbacks).
  virtual std::string state_key() const { return ""; }
  virtual state::StateDict state_dict() const { return {}; }
  virtual void load_state_dict(const state::StateDict& state) {}

  // stage: Stage::Fit, Stage::Validate or Stage::Test.
  virtual void setup(Trainer& trainer, TrainingModule& module, Stage stage) {}
  virtual void teardown(Trainer& trainer, TrainingModule& module, Stage stage) {}
  virtual void on_fit_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_fit_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_train_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_train_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_train_epoch_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_train_epoch_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_train_batch_start(Trainer& trainer, TrainingModule& module, const Batch& batch, int64_t batch_idx) {}
  // `loss`: the batch's loss as training_step returned it (before accumulation scaling).
  virtual void on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor& loss,
                                  const Batch& batch, int64_t batch_idx) {}
  virtual void on_before_backward(Trainer& trainer, TrainingModule& module, const at::Tensor& loss) {}
  virtual void on_after_backward(Trainer& trainer, TrainingModule& module) {}
  virtual void on_before_optimizer_step(Trainer& trainer, TrainingModule& module, torch::optim::Optimizer& opt) {}
  virtual void on_validation_start(Trainer& trainer, TrainingModule& module) {}
  // After the validation loop; the averaged metrics are in trainer.callback_metrics().
  virtual void on_validation_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_validation_batch_end(Trainer& trainer, TrainingModule& module, const Batch& batch,
                                       int64_t batch_idx) {}
  virtual void on_test_start(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_end(Trainer& trainer, TrainingModule& module) {}
  virtual void on_test_batch_end(Trainer& trainer, TrainingModule& module, const Batch& batch, int64_t batch_idx) {}
  // After a checkpoint was written to / restored from `path` (every rank).
  virtual void on_save_checkpoint(Trainer& trainer, TrainingModule& module, const std::string& path) {}
  virtual void on_load_checkpoint(Trainer& trainer, TrainingModule& module, const std::string& path) {}
  virtual void on_exception(Trainer& trainer, TrainingModule& module, const std::exception& e) {}
};
using CallbackPtr = std::shared_ptr<Callback>;

}  // namespace tessera::trainer
