// BatchCount and the Trainer's checks of its inputs (see checks.h): TrainerOptions when a
// Trainer is built, the data given to fit / validate / test, and the optimizers and
// schedulers configure_optimizers returns.
#include "tessera/trainer/checks.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "tessera/core/error.h"
#include "tessera/trainer/callbacks.h"

namespace tessera::trainer {

int64_t BatchCount::of(int64_t available) const {
  if (batches) return std::min(*batches, available);
  const double f = fraction.value_or(1.0);
  if (f <= 0 || available <= 0) return 0;
  const auto n = static_cast<int64_t>(std::floor(f * static_cast<double>(available)));
  return std::clamp<int64_t>(n, 1, available);
}

namespace {

void check_count(const BatchCount& c, const char* name, bool allow_zero) {
  if (c.batches) {
    TESSERA_CHECK(*c.batches >= (allow_zero ? 0 : 1), "TrainerOptions.", name, " must be ",
                  allow_zero ? ">= 0" : ">= 1", " batches, got ", *c.batches);
  } else {
    const double f = c.fraction.value_or(1.0);
    TESSERA_CHECK(std::isfinite(f) && f >= 0 && f <= 1 && (allow_zero || f > 0), "TrainerOptions.", name,
                  " must be a fraction in ", allow_zero ? "[0, 1]" : "(0, 1]", " or a number of batches, got ", f);
  }
}

}  // namespace

TrainerOptions checked_options(TrainerOptions o) {
  TESSERA_CHECK(o.batch_size >= 1, "TrainerOptions.batch_size must be at least 1, got ", o.batch_size);
  TESSERA_CHECK(o.eval_batch_size >= 0, "TrainerOptions.eval_batch_size must be >= 0 (0: batch_size), got ",
                o.eval_batch_size);
  TESSERA_CHECK(o.log_every_n_steps >= 1, "TrainerOptions.log_every_n_steps must be at least 1, got ",
                o.log_every_n_steps);
  TESSERA_CHECK(o.max_steps >= -1, "TrainerOptions.max_steps must be -1 (no limit) or >= 0, got ", o.max_steps);
  TESSERA_CHECK(o.max_epochs >= -1, "TrainerOptions.max_epochs must be -1 (no limit) or >= 0, got ", o.max_epochs);
  TESSERA_CHECK(o.checkpoint_every_n_train_steps >= 0, "TrainerOptions.checkpoint_every_n_train_steps must be >= 0, got ",
                o.checkpoint_every_n_train_steps);
  TESSERA_CHECK(o.accumulate_grad_batches >= 1, "TrainerOptions.accumulate_grad_batches must be at least 1, got ",
                o.accumulate_grad_batches);
  TESSERA_CHECK(!o.gradient_clip_val || (std::isfinite(*o.gradient_clip_val) && *o.gradient_clip_val > 0),
                "TrainerOptions.gradient_clip_val must be positive, got ", o.gradient_clip_val.value_or(0));
  TESSERA_CHECK(o.gradient_clip_algorithm == "norm" || o.gradient_clip_algorithm == "value",
                "TrainerOptions.gradient_clip_algorithm must be \"norm\" or \"value\", got \"", o.gradient_clip_algorithm,
                "\"");
  check_count(o.val_check_interval, "val_check_interval", false);
  check_count(o.limit_train_batches, "limit_train_batches", true);
  check_count(o.limit_val_batches, "limit_val_batches", true);
  check_count(o.limit_test_batches, "limit_test_batches", true);
  TESSERA_CHECK(o.check_val_every_n_epoch >= 1, "TrainerOptions.check_val_every_n_epoch must be at least 1, got ",
                o.check_val_every_n_epoch);
  TESSERA_CHECK(o.num_sanity_val_steps >= 0, "TrainerOptions.num_sanity_val_steps must be >= 0, got ",
                o.num_sanity_val_steps);
  TESSERA_CHECK(o.progress_bar.refresh_rate >= 1, "TrainerOptions.progress_bar.refresh_rate must be at least 1, got ",
                o.progress_bar.refresh_rate);
  std::set<std::string> keys;
  bool has_checkpoint = false;
  for (size_t i = 0; i < o.callbacks.size(); ++i) {
    TESSERA_CHECK(o.callbacks[i] != nullptr, "TrainerOptions.callbacks[", i, "] is null");
    has_checkpoint = has_checkpoint || std::dynamic_pointer_cast<ModelCheckpoint>(o.callbacks[i]) != nullptr;
    const std::string k = o.callbacks[i]->state_key();
    if (k.empty()) continue;
    TESSERA_CHECK(k.find('.') == std::string::npos, "TrainerOptions.callbacks[", i, "]: state_key '", k,
                  "' contains a '.'");
    TESSERA_CHECK(keys.insert(k).second, "TrainerOptions.callbacks[", i, "]: state_key '", k,
                  "' is used by another callback (two callbacks with the same configuration?)");
  }
  TESSERA_CHECK(o.enable_checkpointing || !has_checkpoint,
                "TrainerOptions.callbacks has a ModelCheckpoint but enable_checkpointing is false");
  for (size_t i = 0; i < o.loggers.size(); ++i)
    TESSERA_CHECK(o.loggers[i] != nullptr, "TrainerOptions.loggers[", i, "] is null");
  TESSERA_CHECK(o.enable_logger || o.loggers.empty(), "TrainerOptions.loggers is set but enable_logger is false");
  if (o.max_steps == -1 && o.max_epochs == -1) o.max_epochs = 1000;  // Lightning's default
  // Like Lightning's Trainer: consolidated checkpoints unless asked otherwise.
  if (!o.fabric.state_dict_type) o.fabric.state_dict_type = strategy::StateDictType::Full;
  return o;
}

void check_data(const TensorData& d, const char* fn, const char* what, bool allow_empty) {
  if (allow_empty && !d.inputs.defined() && !d.targets.defined()) return;
  TESSERA_CHECK(d.inputs.defined() && d.targets.defined(), fn, ": the ", what, " data has no ",
                d.inputs.defined() ? "targets" : "inputs");
  TESSERA_CHECK(d.inputs.dim() >= 1 && d.targets.dim() >= 1 && d.inputs.size(0) == d.targets.size(0), fn, ": the ",
                what, " inputs have ", d.inputs.dim() ? d.inputs.size(0) : 0, " rows but its targets ",
                d.targets.dim() ? d.targets.size(0) : 0);
  TESSERA_CHECK(allow_empty || d.size() > 0, fn, ": the ", what, " data has no samples");
}

void check_optimizer_config(const OptimizerConfig& oc) {
  TESSERA_CHECK(!oc.optimizers.empty(), "TrainingModule::configure_optimizers returned no optimizer");
  for (size_t i = 0; i < oc.optimizers.size(); ++i)
    TESSERA_CHECK(oc.optimizers[i] != nullptr, "TrainingModule::configure_optimizers: optimizer ", i, " is null");
  for (size_t i = 0; i < oc.schedulers.size(); ++i) {
    const SchedulerConfig& s = oc.schedulers[i];
    TESSERA_CHECK(s.scheduler != nullptr, "OptimizerConfig.schedulers[", i, "].scheduler is null");
    TESSERA_CHECK(s.interval == Interval::Step || s.interval == Interval::Epoch, "OptimizerConfig.schedulers[", i,
                  "].interval must be Interval::Step or Interval::Epoch, got the value ", static_cast<int>(s.interval));
    TESSERA_CHECK(s.frequency >= 1, "OptimizerConfig.schedulers[", i, "].frequency must be at least 1, got ",
                  s.frequency);
    TESSERA_CHECK(std::find(oc.optimizers.begin(), oc.optimizers.end(), s.scheduler->optimizer()) !=
                      oc.optimizers.end(),
                  "OptimizerConfig.schedulers[", i, "]: its optimizer is not one of the configured optimizers");
  }
}

}  // namespace tessera::trainer
