// Trainer construction and glue: the callbacks (default ModelCheckpoint last), loggers
// and progress bar it builds; attaching the module and setting up its model and
// optimizers; metric logging; batches; scheduler stepping. The loops and checkpoints
// are in fit_loop.cpp, eval_loop.cpp and trainer_checkpoint.cpp; option checks in
// checks.cpp.
#include "tessera/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <cstring>

#include "tessera/core/error.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/checks.h"
#include "tessera/trainer/csv_logger.h"

namespace tessera::trainer {

namespace {

// Metrics as bytes (name, NUL, the double) for rank_zero_metrics' broadcast, and back.
std::string encode_metrics(const Metrics& m) {
  std::string out;
  for (const auto& [k, v] : m) {
    out += k;
    out.push_back('\0');
    out.append(reinterpret_cast<const char*>(&v), sizeof(double));
  }
  return out;
}

Metrics decode_metrics(const std::string& s) {
  Metrics m;
  size_t p = 0;
  while (p < s.size()) {
    const size_t z = s.find('\0', p);
    double v;
    std::memcpy(&v, s.data() + z + 1, sizeof(double));
    m[s.substr(p, z - p)] = v;
    p = z + 1 + sizeof(double);
  }
  return m;
}

}  // namespace

Trainer::Trainer(TrainerOptions options) : options_(checked_options(std::move(options))) {
  fabric_ = std::make_unique<fabric::Fabric>(options_.fabric);
  fabric_->launch();
  // ModelCheckpoints run last (Lightning's order), so the state they save includes what
  // the other callbacks did in the same hook.
  std::vector<CallbackPtr> checkpoints;
  for (auto& c : options_.callbacks) {
    if (std::dynamic_pointer_cast<ModelCheckpoint>(c)) checkpoints.push_back(c);
    else callbacks_.push_back(c);
  }
  if (options_.enable_checkpointing && checkpoints.empty()) {
    ModelCheckpointOptions mo;
    mo.save_last = true;
    mo.save_top_k = 0;
    mo.every_n_train_steps = options_.checkpoint_every_n_train_steps;
    mo.async_save = options_.checkpoint_async;
    checkpoints.push_back(std::make_shared<ModelCheckpoint>(mo));
  }
  callbacks_.insert(callbacks_.end(), checkpoints.begin(), checkpoints.end());
  loggers_ = options_.loggers;
  if (options_.enable_logger && loggers_.empty()) loggers_.push_back(std::make_shared<CsvLogger>(options_.default_root_dir));
  if (options_.enable_progress_bar && fabric_->is_global_zero())
    bar_ = std::make_unique<ProgressBar>(options_.progress_bar);
  if (options_.deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

Trainer::~Trainer() = default;

std::shared_ptr<ModelCheckpoint> Trainer::checkpoint_callback() const {
  for (auto& c : callbacks_)
    if (auto m = std::dynamic_pointer_cast<ModelCheckpoint>(c)) return m;
  return nullptr;
}

std::shared_ptr<EarlyStopping> Trainer::early_stopping_callback() const {
  for (auto& c : callbacks_)
    if (auto m = std::dynamic_pointer_cast<EarlyStopping>(c)) return m;
  return nullptr;
}

std::string Trainer::log_dir() const {
  return loggers_set_up_ && !loggers_.empty() ? loggers_.front()->log_dir() : std::string();
}

Metrics Trainer::rank_zero_metrics() {
  if (fabric_->world_size() == 1) return callback_metrics_;
  return decode_metrics(fabric_->broadcast(encode_metrics(callback_metrics_), 0));
}

void Trainer::log_metric(const std::string& name, double value, bool prog_bar, bool sync_dist) {
  TESSERA_CHECK(!name.empty(), "TrainingModule::log: empty metric name");
  if (in_eval_) {
    EvalAcc& a = eval_acc_[name];
    a.sum += value * static_cast<double>(eval_rows_);
    a.weight += static_cast<double>(eval_rows_);
    a.sync = a.sync || sync_dist;
    a.prog_bar = a.prog_bar || prog_bar;
    return;
  }
  if (sync_dist) value = fabric_->all_reduce(value, distributed::ReduceOp::Avg);
  step_metrics_[name] = value;
  callback_metrics_[name] = value;
  if (prog_bar) progress_bar_metrics_[name] = value;
}

void Trainer::log_to_loggers(const Metrics& metrics, int64_t step) {
  Metrics m = metrics;
  m["epoch"] = static_cast<double>(epoch_);
  logged_metrics_ = m;
  for (auto& l : loggers_) {
    l->log_metrics(m, step);
    l->save();
  }
}

void Trainer::setup_loggers(TrainingModule& module) {
  if (loggers_set_up_) return;
  auto share = [this](const std::string& s) { return fabric_->broadcast(s, 0); };
  for (auto& l : loggers_) {
    l->setup(fabric_->is_global_zero(), share);
    l->log_hyperparams(module.hparams());
  }
  loggers_set_up_ = true;
}

void Trainer::attach(TrainingModule& module) {
  TESSERA_CHECK(module_ == nullptr || module_ == &module,
                "Trainer: this Trainer was used with another TrainingModule; use a new Trainer per module");
  module_ = &module;
  module.trainer_ = this;
}

void Trainer::setup_model(TrainingModule& module, bool with_optimizers) {
  if (setup_ == Setup::None) {
    setup_ = Setup::ConfiguringModel;
    torch::nn::AnyModule built;
    try {
      built = module.configure_model();
    } catch (...) {
      setup_ = Setup::None;
      throw;
    }
    setup_ = Setup::None;
    module.model_ = fabric_->setup_module(std::move(built));
    setup_ = Setup::Model;
  }
  if (!with_optimizers || setup_ == Setup::Optimizers) return;
  OptimizerConfig oc = module.configure_optimizers();
  check_optimizer_config(oc);
  optimizers_ = oc.optimizers;
  schedulers_ = oc.schedulers;
  fabric_->setup_optimizers(optimizers_);
  setup_ = Setup::Optimizers;
}

void Trainer::step_schedulers(Interval interval) {
  for (auto& s : schedulers_) {
    if (s.interval != interval) continue;
    const int64_t n = interval == Interval::Step ? global_step_ : epoch_ + 1;
    if (n % s.frequency == 0) s.scheduler->step();
  }
}

Batch Trainer::make_batch(const TensorData& data, const std::vector<size_t>& idx) const {
  at::Tensor rows = at::tensor(std::vector<int64_t>(idx.begin(), idx.end()), at::kLong);
  const c10::Device dev = fabric_->device();
  return Batch{data.inputs.index_select(0, rows).to(dev), data.targets.index_select(0, rows).to(dev), idx};
}

void Trainer::notify_exception(TrainingModule& module, const std::exception& e) {
  for (auto& c : callbacks_) {
    try {
      c->on_exception(*this, module, e);
    } catch (...) {
    }
  }
}

}  // namespace tessera::trainer
