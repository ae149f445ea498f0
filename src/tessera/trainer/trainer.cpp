#include "tessera/trainer/trainer.h"

#include <ATen/ATen.h>

#include <filesystem>

#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

// --- TrainingModule -------------------------------------------------------------------

torch::nn::AnyModule& TrainingModule::model() {
  TESSERA_CHECK(trainer_ && !model_.is_empty(), "TrainingModule::model(): only valid during Trainer::fit, after ",
                "configure_model");
  return model_;
}

fabric::Fabric& TrainingModule::fabric() {
  TESSERA_CHECK(trainer_, "TrainingModule::fabric(): only valid during Trainer::fit");
  return trainer_->fabric();
}

void TrainingModule::log(const std::string& name, double value, bool sync_dist) {
  TESSERA_CHECK(trainer_, "TrainingModule::log('", name, "'): only valid during Trainer::fit");
  trainer_->log_metric(name, value, sync_dist);
}

// --- Trainer ---------------------------------------------------------------------------

namespace {

TrainerOptions checked(TrainerOptions o) {
  TESSERA_CHECK(o.batch_size >= 1, "TrainerOptions.batch_size must be at least 1, got ", o.batch_size);
  TESSERA_CHECK(o.log_every_n_steps >= 1, "TrainerOptions.log_every_n_steps must be at least 1, got ",
                o.log_every_n_steps);
  TESSERA_CHECK(o.max_steps >= -1, "TrainerOptions.max_steps must be -1 (no limit) or >= 0, got ", o.max_steps);
  TESSERA_CHECK(o.max_epochs >= -1, "TrainerOptions.max_epochs must be -1 (no limit) or >= 0, got ", o.max_epochs);
  TESSERA_CHECK(o.checkpoint_every_n_train_steps >= 0, "TrainerOptions.checkpoint_every_n_train_steps must be >= 0, got ",
                o.checkpoint_every_n_train_steps);
  TESSERA_CHECK(!o.gradient_clip_val || *o.gradient_clip_val > 0, "TrainerOptions.gradient_clip_val must be positive");
  if (o.max_steps == -1 && o.max_epochs == -1) o.max_epochs = 1000;  // Lightning's default
  // Like Lightning's Trainer: consolidated checkpoints unless asked otherwise.
  if (!o.fabric.state_dict_type) o.fabric.state_dict_type = strategy::StateDictType::Full;
  return o;
}

state::StateDict prefixed_leftovers(const state::StateDict& rest, const std::string& prefix) {
  state::StateDict out;
  rest.for_each([&](const std::string& k, const state::Value& v) {
    if (k.rfind(prefix + ".", 0) == 0) out.set(k.substr(prefix.size() + 1), v);
  });
  return out;
}

}  // namespace

Trainer::Trainer(TrainerOptions options) : options_(checked(std::move(options))) {
  fabric_ = std::make_unique<fabric::Fabric>(options_.fabric);
  fabric_->launch();
}

Trainer::~Trainer() = default;

void Trainer::log_metric(const std::string& name, double value, bool sync_dist) {
  pending_metrics_[name] = sync_dist ? fabric_->all_reduce(value, dist::ReduceOp::Avg) : value;
}

fabric::FabricState Trainer::make_state(std::vector<fabric::OptimizerPtr>& opts) {
  fabric::FabricState st;
  st.set("model", module_->model_);
  for (size_t i = 0; i < opts.size(); ++i) st.set("optimizer_" + std::to_string(i), opts[i]);
  st.set("global_step", global_step_).set("epoch", epoch_).set("sampler", sampler_->state());
  return st;
}

void Trainer::save_checkpoint(const std::string& path) {
  TESSERA_CHECK(module_ && model_set_up_, "Trainer::save_checkpoint: no model yet (call fit first)");
  fabric::FabricState st = make_state(optimizers_);
  state::StateDict extra, hp;
  module_->on_save_checkpoint(extra);
  for (const auto& [k, v] : module_->hparams()) hp.set(k, v);
  st.set("extra", extra).set("hparams", hp);
  std::error_code ec;
  if (fabric_->is_global_zero()) fs::create_directories(fs::path(path).parent_path(), ec);
  fabric_->barrier();
  fabric_->save(path, st);
}

void Trainer::fit(TrainingModule& module, const TensorData& train, const std::string& ckpt_path) {
  TESSERA_CHECK(!model_set_up_, "Trainer::fit: this Trainer already trained a model; use a new Trainer per fit");
  TESSERA_CHECK(train.inputs.defined() && train.targets.defined(), "Trainer::fit: the training data is empty");
  TESSERA_CHECK(train.inputs.size(0) == train.targets.size(0), "Trainer::fit: inputs have ", train.inputs.size(0),
                " rows but targets ", train.targets.size(0));
  TESSERA_CHECK(train.size() > 0, "Trainer::fit: the training data has no samples");
  auto& f = *fabric_;
  module_ = &module;
  module.trainer_ = this;
  struct Detach {
    TrainingModule* m;
    ~Detach() { m->trainer_ = nullptr; }
  } detach{&module};

  module.model_ = f.setup_module(module.configure_model());
  model_set_up_ = true;
  optimizers_ = module.configure_optimizers();
  TESSERA_CHECK(!optimizers_.empty(), "TrainingModule::configure_optimizers returned no optimizer");
  f.setup_optimizers(optimizers_);
  fabric::SamplerOptions so;
  so.shuffle = options_.shuffle;
  so.seed = options_.seed;
  sampler_ = std::make_unique<fabric::DistributedSampler>(f.distributed_sampler(static_cast<size_t>(train.size()), so));

  if (options_.enable_logger) {
    std::string dir = f.is_global_zero() ? CsvLogger::next_version_dir(options_.default_root_dir) : std::string();
    dir = f.broadcast(dir, 0);
    logger_ = std::make_unique<CsvLogger>(dir, f.is_global_zero());
    logger_->log_hparams(module.hparams());
  }
  const std::string last = (fs::path(options_.default_root_dir) / "checkpoints" / "last.ckpt").string();

  if (!ckpt_path.empty()) {
    const std::string path = ckpt_path == "last" ? last : ckpt_path;
    TESSERA_CHECK(fs::exists(path), "Trainer::fit: checkpoint '", path, "' does not exist",
                  ckpt_path == "last" ? " (ckpt_path \"last\")" : "");
    fabric::FabricState st = make_state(optimizers_);
    state::StateDict rest = f.load(path, st);
    global_step_ = st.values().integer("global_step");
    epoch_ = st.values().integer("epoch");
    sampler_->load_state(st.values().dict("sampler"));
    module.on_load_checkpoint(prefixed_leftovers(rest, "extra"));
  }

  auto done = [&] {
    return (options_.max_steps >= 0 && global_step_ >= options_.max_steps) ||
           (options_.max_epochs >= 0 && epoch_ >= options_.max_epochs);
  };
  const size_t bs = static_cast<size_t>(options_.batch_size);
  module.on_fit_start();
  while (!done()) {
    if (sampler_->position() == 0) sampler_->set_epoch(epoch_);  // a resumed epoch keeps its position
    module.epoch_ = epoch_;
    module.on_train_epoch_start(epoch_);
    int64_t batch_idx = static_cast<int64_t>(sampler_->position() / bs);
    while (!done()) {
      c10::optional<std::vector<size_t>> idx = sampler_->next(bs);
      if (!idx) break;
      at::Tensor rows = at::tensor(std::vector<int64_t>(idx->begin(), idx->end()), at::kLong);
      Batch b{train.inputs.index_select(0, rows).to(f.device()), train.targets.index_select(0, rows).to(f.device()),
              *idx};
      module.global_step_ = global_step_;
      at::Tensor loss = module.training_step(b, batch_idx++);
      TESSERA_CHECK(loss.defined() && loss.numel() == 1, "TrainingModule::training_step must return a scalar loss");
      f.backward(loss);
      if (options_.gradient_clip_val) f.clip_grad_norm(*options_.gradient_clip_val);
      for (auto& o : optimizers_) {
        f.step(o);
        o->zero_grad();
      }
      ++global_step_;
      module.global_step_ = global_step_;
      pending_metrics_["train_loss"] = f.all_reduce(loss.item<double>(), dist::ReduceOp::Avg);
      if (logger_ && global_step_ % options_.log_every_n_steps == 0) {
        logger_->log_metrics(pending_metrics_, global_step_, epoch_);
        logger_->save();
      }
      pending_metrics_.clear();
      if (options_.enable_checkpointing && options_.checkpoint_every_n_train_steps > 0 &&
          global_step_ % options_.checkpoint_every_n_train_steps == 0) {
        save_checkpoint(last);
        last_ckpt_ = last;
      }
    }
    if (sampler_->position() >= sampler_->num_samples()) {  // the epoch is complete
      module.on_train_epoch_end(epoch_);
      ++epoch_;
      sampler_->set_epoch(epoch_);
    }
  }
  module.global_step_ = global_step_;
  module.epoch_ = epoch_;
  if (options_.enable_checkpointing) {
    save_checkpoint(last);
    last_ckpt_ = last;
  }
  if (logger_) logger_->save();
  module.on_fit_end();
}

}  // namespace tessera::trainer
