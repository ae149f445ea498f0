// Trainer::fit, step by step: preparing the run (model, optimizers, sampler, batch
// counts, resume), epochs of training batches (forward, backward with gradient
// accumulation, clipping, optimizer and scheduler steps, logging), validation at the
// configured interval, the end of each epoch and of the fit. The loop's position (the
// sampler's and loop_.position) is what a checkpoint saves, so a resumed fit continues
// exactly where the saved one stood.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "tessera/core/error.h"
#include "tessera/trainer/checks.h"
#include "tessera/trainer/trainer.h"

namespace tessera::trainer {

struct Trainer::FitContext {
  TrainingModule& module;
  const TensorData& train;
  const TensorData& val;
  int64_t val_batches = 0;  // validation batches per validation run (0: no validation)
  int64_t val_every = 1;    // validate after every val_every training batches of an epoch
  double loss_sum = 0;      // losses of the current optimizer step's micro-batches
};

Metrics Trainer::fit(TrainingModule& module, const TensorData& train, const TensorData& val,
                     const std::string& ckpt_path) {
  TESSERA_CHECK(!fitted_, "Trainer::fit: this Trainer already ran fit; use a new Trainer per fit");
  check_data(train, "Trainer::fit", "training", false);
  check_data(val, "Trainer::fit", "validation", true);
  attach(module);
  fitted_ = true;
  StageScope scope{&module, stage_};
  stage_ = Stage::Fit;
  loop_ = LoopState{};
  FitContext fit{module, train, val};
  prepare_fit(fit, ckpt_path);
  try {
    module.on_fit_start();
    each_callback([&](Callback& c) { c.on_fit_start(*this, module); });
    if (options_.num_sanity_val_steps > 0 && loop_.has_validation && ckpt_path.empty())
      run_eval(module, val, Stage::Validate, std::min(fit.val_batches, options_.num_sanity_val_steps), /*sanity=*/true);
    module.on_train_start();
    each_callback([&](Callback& c) { c.on_train_start(*this, module); });
    // A checkpoint saved between a batch and its validation, or after the epoch's end hooks.
    if (loop_.position == LoopPosition::ValidationDue) validate_in_fit(fit);
    while (!fit_done()) {
      if (loop_.position == LoopPosition::EpochEnded) end_epoch(fit);
      else run_epoch(fit);
    }
    finish_fit(fit);
  } catch (const std::exception& e) {
    notify_exception(module, e);
    throw;
  }
  return callback_metrics_;
}

// Model and optimizers, the training sampler, loggers, the batch counts and the
// validation interval; callbacks' setup; then the checkpoint to resume from, if any.
void Trainer::prepare_fit(FitContext& fit, const std::string& ckpt_path) {
  TrainingModule& module = fit.module;
  setup_model(module, /*with_optimizers=*/true);
  fabric::SamplerOptions so;
  so.shuffle = options_.shuffle;
  so.seed = options_.seed;
  sampler_ = std::make_unique<fabric::DistributedSampler>(
      fabric_->distributed_sampler(static_cast<size_t>(fit.train.size()), so));
  setup_loggers(module);

  const int64_t bs = options_.batch_size;
  const int64_t available = (static_cast<int64_t>(sampler_->num_samples()) + bs - 1) / bs;
  num_training_batches_ = options_.limit_train_batches.of(available);
  TESSERA_CHECK(num_training_batches_ > 0, "Trainer::fit: no training batches (TrainerOptions.limit_train_batches ",
                "leaves 0 of ", available, ")");
  fit.val_batches = eval_batches(fit.val, options_.limit_val_batches);
  loop_.has_validation = fit.val_batches > 0;
  if (loop_.has_validation) {
    if (options_.val_check_interval.batches) {
      fit.val_every = *options_.val_check_interval.batches;
      TESSERA_CHECK(fit.val_every <= num_training_batches_, "TrainerOptions.val_check_interval (", fit.val_every,
                    " batches) is more than the ", num_training_batches_, " training batches of an epoch");
    } else {
      fit.val_every = std::max<int64_t>(
          1, static_cast<int64_t>(std::floor(options_.val_check_interval.fraction.value_or(1.0) *
                                             static_cast<double>(num_training_batches_))));
    }
  }
  each_callback([&](Callback& c) { c.setup(*this, module, Stage::Fit); });  // fit_has_validation() is known
  loop_.position = LoopPosition::InEpoch;
  if (!ckpt_path.empty()) {
    const std::string path = resolve_ckpt_path(ckpt_path);  // "" when "auto" found none: start fresh
    if (!path.empty()) load_checkpoint(path, /*weights_only=*/false);
  }
  module.global_step_ = global_step_;
  module.epoch_ = epoch_;
}

bool Trainer::fit_done() const {
  return loop_.should_stop || (options_.max_steps >= 0 && global_step_ >= options_.max_steps) ||
         (options_.max_epochs >= 0 && epoch_ >= options_.max_epochs);
}

// The training batches of the current epoch from the sampler's position (a resumed
// epoch keeps it), then the epoch's end unless fit stopped first.
void Trainer::run_epoch(FitContext& fit) {
  if (sampler_->position() == 0) sampler_->set_epoch(epoch_);  // a resumed epoch keeps its position
  fit.module.epoch_ = epoch_;
  const int64_t bs = options_.batch_size;
  int64_t batch_idx = static_cast<int64_t>(sampler_->position()) / bs;
  if (batch_idx < num_training_batches_) start_epoch(fit);  // not a resumed epoch whose batches are all done
  fit.loss_sum = 0;
  while (!fit_done() && batch_idx < num_training_batches_) {
    c10::optional<std::vector<size_t>> idx = sampler_->next(static_cast<size_t>(bs));
    if (!idx) break;
    train_batch(fit, make_batch(fit.train, *idx), batch_idx);
    ++batch_idx;
  }
  if (batch_idx >= num_training_batches_ || sampler_->position() >= sampler_->num_samples()) end_epoch(fit);
  else if (bar_) bar_->finish();
}

void Trainer::start_epoch(FitContext& fit) {
  fit.module.on_train_epoch_start(epoch_);
  each_callback([&](Callback& c) { c.on_train_epoch_start(*this, fit.module); });
  if (bar_) bar_->start("train", epoch_, num_training_batches_, options_.max_steps);
}

// One micro-batch: training_step and backward; the optimizer step when it is the last
// of its accumulation group; then the batch-end hooks and, when due, validation.
void Trainer::train_batch(FitContext& fit, const Batch& b, int64_t batch_idx) {
  TrainingModule& module = fit.module;
  // The optimizer step this micro-batch belongs to: batches [group_start, group_start + group).
  const int64_t k = options_.accumulate_grad_batches;
  const int64_t group_start = batch_idx / k * k;
  const int64_t group = std::min(group_start + k, num_training_batches_) - group_start;
  const bool last = batch_idx + 1 == group_start + group;
  loop_.optimizer_stepped = false;
  module.global_step_ = global_step_;
  module.on_train_batch_start(b, batch_idx);
  each_callback([&](Callback& c) { c.on_train_batch_start(*this, module, b, batch_idx); });
  at::Tensor loss = module.training_step(b, batch_idx);
  TESSERA_CHECK(loss.defined() && loss.numel() == 1, "TrainingModule::training_step must return a scalar loss");
  backward(fit, loss, group, last);
  fit.loss_sum += loss.detach().to(at::kCPU).to(at::kDouble).item<double>();
  if (last) optimizer_step(fit, group);
  show_train_progress(batch_idx);
  const bool validate = loop_.has_validation && last && (epoch_ + 1) % options_.check_val_every_n_epoch == 0 &&
                        (batch_idx + 1) / fit.val_every > group_start / fit.val_every;
  loop_.position = validate ? LoopPosition::ValidationDue : LoopPosition::InEpoch;
  module.on_train_batch_end(loss, b, batch_idx);
  each_callback([&](Callback& c) { c.on_train_batch_end(*this, module, loss, b, batch_idx); });
  loop_.optimizer_stepped = false;
  if (loop_.position == LoopPosition::ValidationDue) {
    validate_in_fit(fit);
    show_train_progress(batch_idx);  // the new validation metrics on the training line
  }
}

// Backward of the loss divided by the micro-batches of its step; gradients are
// synchronized only on the last of them.
void Trainer::backward(FitContext& fit, const at::Tensor& loss, int64_t group, bool last) {
  TrainingModule& module = fit.module;
  fabric::NoBackwardSync no_sync = fabric_->no_backward_sync(module.model_, /*enabled=*/!last);
  at::Tensor scaled = group > 1 ? loss / static_cast<double>(group) : loss;
  module.on_before_backward(scaled);
  each_callback([&](Callback& c) { c.on_before_backward(*this, module, scaled); });
  fabric_->backward(scaled);
  module.on_after_backward();
  each_callback([&](Callback& c) { c.on_after_backward(*this, module); });
}

// Clipping, every optimizer's step and zero_grad, the step count, step-interval
// schedulers, and train_loss (the step's mean loss over its micro-batches and ranks).
void Trainer::optimizer_step(FitContext& fit, int64_t group) {
  TrainingModule& module = fit.module;
  for (auto& o : optimizers_) {
    module.on_before_optimizer_step(*o);
    each_callback([&](Callback& c) { c.on_before_optimizer_step(*this, module, *o); });
  }
  clip_gradients();
  for (auto& o : optimizers_) {
    fabric_->step(o);
    module.on_before_zero_grad(*o);
    o->zero_grad();
  }
  ++global_step_;
  module.global_step_ = global_step_;
  step_schedulers(Interval::Step);
  loop_.optimizer_stepped = true;
  const double train_loss = fabric_->all_reduce(fit.loss_sum / static_cast<double>(group), distributed::ReduceOp::Avg);
  fit.loss_sum = 0;
  step_metrics_["train_loss"] = train_loss;
  callback_metrics_["train_loss"] = train_loss;
  if (global_step_ % options_.log_every_n_steps == 0) log_to_loggers(step_metrics_, global_step_);
  step_metrics_.clear();
}

void Trainer::clip_gradients() {
  if (!options_.gradient_clip_val) return;
  if (options_.gradient_clip_algorithm == "norm") fabric_->clip_grad_norm(*options_.gradient_clip_val);
  else fabric_->clip_grad_value(*options_.gradient_clip_val);
}

void Trainer::show_train_progress(int64_t batch_idx) {
  if (!bar_) return;
  Metrics shown = progress_bar_metrics_;
  if (callback_metrics_.count("train_loss")) shown["loss"] = callback_metrics_.at("train_loss");
  bar_->update(batch_idx, global_step_, shown);
}

void Trainer::validate_in_fit(FitContext& fit) {
  loop_.position = LoopPosition::InEpoch;
  run_eval(fit.module, fit.val, Stage::Validate, fit.val_batches, false);
}

// End of a training epoch: hooks, epoch-interval schedulers, callbacks (which may save a
// checkpoint: LoopPosition::EpochEnded tells a resumed run not to repeat them), next epoch.
void Trainer::end_epoch(FitContext& fit) {
  if (loop_.position != LoopPosition::EpochEnded) {
    if (bar_) bar_->finish();
    loop_.position = LoopPosition::EpochEnded;
    fit.module.on_train_epoch_end(epoch_);
    step_schedulers(Interval::Epoch);
    each_callback([&](Callback& c) { c.on_train_epoch_end(*this, fit.module); });
  }
  loop_.position = LoopPosition::InEpoch;
  ++epoch_;
  fit.module.epoch_ = epoch_;
  sampler_->set_epoch(epoch_);
}

// Train-end hooks (ModelCheckpoint's last save), every checkpoint committed, loggers
// finalized, fit-end hooks and teardown.
void Trainer::finish_fit(FitContext& fit) {
  TrainingModule& module = fit.module;
  module.on_train_end();
  each_callback([&](Callback& c) { c.on_train_end(*this, module); });
  wait_for_checkpoint();  // fit returns with every checkpoint committed (or its error)
  for (auto& l : loggers_) l->finalize();
  module.on_fit_end();
  each_callback([&](Callback& c) { c.on_fit_end(*this, module); });
  each_callback([&](Callback& c) { c.teardown(*this, module, Stage::Fit); });
}

}  // namespace tessera::trainer
