// The Trainer's evaluation loops: validate() and test(), the validation inside fit and
// its sanity batches. Metrics logged in validation_step / test_step are averaged over
// the loop's samples (and over ranks for sync_dist names) and recorded when it ends;
// the loop runs without autograd, the model in eval mode, and leaves the RNG streams as
// it found them.
#include <ATen/ATen.h>

#include "tessera/core/error.h"
#include "tessera/trainer/checks.h"
#include "tessera/trainer/rng_state.h"
#include "tessera/trainer/trainer.h"

namespace tessera::trainer {

Metrics Trainer::validate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path) {
  return evaluate(module, data, ckpt_path, Stage::Validate);
}

Metrics Trainer::test(TrainingModule& module, const TensorData& data, const std::string& ckpt_path) {
  return evaluate(module, data, ckpt_path, Stage::Test);
}

Metrics Trainer::evaluate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path,
                          Stage stage) {
  const bool test = stage == Stage::Test;
  const std::string fn = std::string("Trainer::") + to_string(stage);
  check_data(data, fn.c_str(), test ? "test" : "validation", false);
  TESSERA_CHECK(stage_ == Stage::None, fn, ": called during ", to_string(stage_));
  attach(module);
  StageScope scope{&module, stage_};
  stage_ = stage;
  setup_model(module, /*with_optimizers=*/false);
  setup_loggers(module);
  each_callback([&](Callback& c) { c.setup(*this, module, stage); });
  if (!ckpt_path.empty()) {
    const std::string path = resolve_ckpt_path(ckpt_path);  // "" when "auto" found none: start fresh
    if (!path.empty()) load_checkpoint(path, /*weights_only=*/true);
  }
  const int64_t nb = eval_batches(data, test ? options_.limit_test_batches : options_.limit_val_batches);
  Metrics r = run_eval(module, data, stage, nb, false);
  for (auto& l : loggers_) l->finalize();
  each_callback([&](Callback& c) { c.teardown(*this, module, stage); });
  return r;
}

int64_t Trainer::eval_batches(const TensorData& data, const BatchCount& limit) const {
  if (data.empty()) return 0;
  const int64_t w = fabric_->data_parallel_size();
  const int64_t per_rank = (data.size() + w - 1) / w;
  const int64_t ebs = options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size;
  return limit.of((per_rank + ebs - 1) / ebs);
}

// stage: Stage::Validate (validation_step) or Stage::Test (test_step). Sanity batches run
// no hooks and record no metrics.
Metrics Trainer::run_eval(TrainingModule& module, const TensorData& data, Stage stage, int64_t nb, bool sanity) {
  auto& f = *fabric_;
  fabric::SamplerOptions so;
  so.shuffle = false;
  fabric::DistributedSampler sampler = f.distributed_sampler(static_cast<size_t>(data.size()), so);
  const size_t ebs = static_cast<size_t>(options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size);
  const bool val = stage == Stage::Validate;
  auto model = module.model_.ptr();
  const bool was_training = model->is_training();
  model->eval();
  at::NoGradGuard no_grad;
  RngFork rng(f.device());
  if (!sanity) eval_start_hooks(module, stage);
  if (bar_) bar_->start(sanity ? "sanity" : to_string(stage), epoch_, nb);
  eval_acc_.clear();
  in_eval_ = true;
  struct Reset {
    bool& b;
    ~Reset() { b = false; }
  } reset{in_eval_};
  for (int64_t b = 0; b < nb; ++b) {
    c10::optional<std::vector<size_t>> idx = sampler.next(ebs);
    if (!idx) break;
    Batch batch = make_batch(data, *idx);
    eval_rows_ = batch.size();
    if (val) module.validation_step(batch, b);
    else module.test_step(batch, b);
    if (!sanity) {
      if (val) each_callback([&](Callback& c) { c.on_validation_batch_end(*this, module, batch, b); });
      else each_callback([&](Callback& c) { c.on_test_batch_end(*this, module, batch, b); });
    }
    if (bar_) {
      Metrics shown;
      for (auto& [k, a] : eval_acc_)
        if (a.prog_bar && a.weight > 0) shown[k] = a.sum / a.weight;
      bar_->update(b, global_step_, shown);
    }
  }
  in_eval_ = false;
  Metrics res = eval_averages(), shown;
  for (auto& [k, v] : res)
    if (eval_acc_[k].prog_bar) shown[k] = v;
  if (was_training) model->train();
  if (bar_) {
    if (nb > 0) bar_->update(nb - 1, global_step_, shown);  // the summary shows the final (synced) averages
    bar_->finish();
  }
  if (sanity) return res;
  for (auto& [k, v] : res) {
    callback_metrics_[k] = v;
    if (eval_acc_[k].prog_bar) progress_bar_metrics_[k] = v;
  }
  if (!res.empty()) log_to_loggers(res, global_step_);
  eval_end_hooks(module, stage);
  return res;
}

void Trainer::eval_start_hooks(TrainingModule& module, Stage stage) {
  if (stage == Stage::Validate) {
    module.on_validation_start();
    each_callback([&](Callback& c) { c.on_validation_start(*this, module); });
    module.on_validation_epoch_start();
  } else {
    module.on_test_start();
    each_callback([&](Callback& c) { c.on_test_start(*this, module); });
  }
}

void Trainer::eval_end_hooks(TrainingModule& module, Stage stage) {
  if (stage == Stage::Validate) {
    module.on_validation_epoch_end();
    module.on_validation_end();
    each_callback([&](Callback& c) { c.on_validation_end(*this, module); });
  } else {
    module.on_test_end();
    each_callback([&](Callback& c) { c.on_test_end(*this, module); });
  }
}

// The loop's averages: over this rank's samples, and over every rank's for sync_dist
// names (one all-reduce of their sums and weights). Names with no samples are left out.
Metrics Trainer::eval_averages() {
  auto& f = *fabric_;
  std::vector<std::string> synced;
  for (auto& [k, a] : eval_acc_)
    if (a.sync) synced.push_back(k);
  if (!synced.empty() && f.world_size() > 1) {
    at::Tensor t = at::empty({static_cast<int64_t>(synced.size()) * 2}, at::kDouble);
    for (size_t i = 0; i < synced.size(); ++i) {
      t[static_cast<int64_t>(2 * i)] = eval_acc_[synced[i]].sum;
      t[static_cast<int64_t>(2 * i + 1)] = eval_acc_[synced[i]].weight;
    }
    t = f.all_reduce(t, distributed::ReduceOp::Sum);
    for (size_t i = 0; i < synced.size(); ++i) {
      eval_acc_[synced[i]].sum = t[static_cast<int64_t>(2 * i)].item<double>();
      eval_acc_[synced[i]].weight = t[static_cast<int64_t>(2 * i + 1)].item<double>();
    }
  }
  Metrics res;
  for (auto& [k, a] : eval_acc_)
    if (a.weight > 0) res[k] = a.sum / a.weight;
  return res;
}

}  // namespace tessera::trainer
