#include "tessera/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <set>

#include "tessera/checkpoint/metadata.h"
#include "tessera/core/error.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/csv_logger.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

int64_t BatchCount::of(int64_t available) const {
  if (batches) return std::min(*batches, available);
  const double f = fraction.value_or(1.0);
  if (f <= 0 || available <= 0) return 0;
  const auto n = static_cast<int64_t>(std::floor(f * static_cast<double>(available)));
  return std::clamp<int64_t>(n, 1, available);
}

// --- TrainingModule -------------------------------------------------------------------

void TrainingModule::validation_step(const Batch&, int64_t) {
  throw Error("Trainer: validation data was given but the TrainingModule does not override validation_step");
}

void TrainingModule::test_step(const Batch&, int64_t) {
  throw Error("Trainer::test: the TrainingModule does not override test_step");
}

torch::nn::AnyModule& TrainingModule::model() {
  TESSERA_CHECK(trainer_ && !model_.is_empty(), "TrainingModule::model(): only valid during Trainer::fit/validate/",
                "test, after configure_model");
  return model_;
}

fabric::Fabric& TrainingModule::fabric() {
  TESSERA_CHECK(trainer_, "TrainingModule::fabric(): only valid during Trainer::fit/validate/test");
  return trainer_->fabric();
}

torch::nn::AnyModule TrainingModule::init_module(const std::function<torch::nn::AnyModule()>& build) {
  TESSERA_CHECK(trainer_ && trainer_->configuring_model_,
                "TrainingModule::init_module: only valid inside configure_model()");
  return trainer_->fabric().init_module(build);
}

Trainer& TrainingModule::trainer() {
  TESSERA_CHECK(trainer_, "TrainingModule::trainer(): only valid during Trainer::fit/validate/test");
  return *trainer_;
}

void TrainingModule::log(const std::string& name, double value, bool prog_bar, bool sync_dist) {
  TESSERA_CHECK(trainer_, "TrainingModule::log('", name, "'): only valid during Trainer::fit/validate/test");
  trainer_->log_metric(name, value, prog_bar, sync_dist);
}

void TrainingModule::log(const std::string& name, const at::Tensor& value, bool prog_bar, bool sync_dist) {
  TESSERA_CHECK(value.defined() && value.numel() == 1, "TrainingModule::log('", name,
                "'): the tensor must have exactly one element, got ",
                value.defined() ? std::to_string(value.numel()) : std::string("an undefined tensor"));
  log(name, value.detach().to(at::kCPU).to(at::kDouble).item<double>(), prog_bar, sync_dist);
}

void TrainingModule::log_dict(const Metrics& metrics, bool prog_bar, bool sync_dist) {
  for (const auto& [k, v] : metrics) log(k, v, prog_bar, sync_dist);
}

// --- Trainer ---------------------------------------------------------------------------

namespace {

// The largest step, epoch or sampler position a checkpoint may hold (2^40: over a thousand
// years of steps at 30 per second); anything above is an edited or corrupt file.
constexpr int64_t kMaxCheckpointCounter = int64_t(1) << 40;

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

TrainerOptions checked(TrainerOptions o) {
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

state::StateDict prefixed_leftovers(const state::StateDict& rest, const std::string& prefix) {
  state::StateDict out;
  rest.for_each([&](const std::string& k, const state::Value& v) {
    if (k.rfind(prefix + ".", 0) == 0) out.set(k.substr(prefix.size() + 1), v);
  });
  return out;
}

std::string generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor s = gen.get_state().contiguous();
  return std::string(static_cast<const char*>(s.data_ptr()), static_cast<size_t>(s.numel()));
}

void set_generator_state(at::Generator gen, const std::string& bytes) {
  at::Tensor s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(s);
}

// Saves the default generators' states and restores them on destruction: validation
// never moves the training RNG streams.
struct RngFork {
  std::string cpu, cuda;
  std::optional<c10::Device> dev;
  explicit RngFork(c10::Device d) {
    cpu = generator_state(at::detail::getDefaultCPUGenerator());
    if (d.is_cuda()) {
      dev = d;
      cuda = generator_state(at::globalContext().defaultGenerator(d));
    }
  }
  ~RngFork() {
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
    if (dev) set_generator_state(at::globalContext().defaultGenerator(*dev), cuda);
  }
};

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

Trainer::Trainer(TrainerOptions options) : options_(checked(std::move(options))) {
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

template <typename F>
void Trainer::each_callback(F&& f) {
  for (auto& c : callbacks_) f(*c);
}

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
  if (!model_set_up_) {
    configuring_model_ = true;
    torch::nn::AnyModule built;
    try {
      built = module.configure_model();
    } catch (...) {
      configuring_model_ = false;
      throw;
    }
    configuring_model_ = false;
    module.model_ = fabric_->setup_module(std::move(built));
    model_set_up_ = true;
  }
  if (!with_optimizers || optimizers_set_up_) return;
  OptimizerConfig oc = module.configure_optimizers();
  TESSERA_CHECK(!oc.optimizers.empty(), "TrainingModule::configure_optimizers returned no optimizer");
  for (size_t i = 0; i < oc.optimizers.size(); ++i)
    TESSERA_CHECK(oc.optimizers[i] != nullptr, "TrainingModule::configure_optimizers: optimizer ", i, " is null");
  for (size_t i = 0; i < oc.schedulers.size(); ++i) {
    const SchedulerConfig& s = oc.schedulers[i];
    TESSERA_CHECK(s.scheduler != nullptr, "OptimizerConfig.schedulers[", i, "].scheduler is null");
    TESSERA_CHECK(s.interval == "step" || s.interval == "epoch", "OptimizerConfig.schedulers[", i,
                  "].interval must be \"step\" or \"epoch\", got \"", s.interval, "\"");
    TESSERA_CHECK(s.frequency >= 1, "OptimizerConfig.schedulers[", i, "].frequency must be at least 1, got ",
                  s.frequency);
    TESSERA_CHECK(std::find(oc.optimizers.begin(), oc.optimizers.end(), s.scheduler->optimizer()) !=
                      oc.optimizers.end(),
                  "OptimizerConfig.schedulers[", i, "]: its optimizer is not one of the configured optimizers");
  }
  optimizers_ = oc.optimizers;
  schedulers_ = oc.schedulers;
  fabric_->setup_optimizers(optimizers_);
  optimizers_set_up_ = true;
}

void Trainer::step_schedulers(const std::string& interval) {
  for (auto& s : schedulers_) {
    if (s.interval != interval) continue;
    const int64_t n = interval == "step" ? global_step_ : epoch_ + 1;
    if (n % s.frequency == 0) s.scheduler->step();
  }
}

fabric::FabricState Trainer::make_state() {
  fabric::FabricState st;
  st.set("model", module_->model_);
  for (size_t i = 0; i < optimizers_.size(); ++i) st.set("optimizer_" + std::to_string(i), optimizers_[i]);
  st.set("global_step", global_step_).set("epoch", epoch_);
  if (sampler_) st.set("sampler", sampler_->state());
  return st;
}

fabric::FabricState Trainer::checkpoint_state(const std::string& path) {
  TESSERA_CHECK(module_ && model_set_up_ && optimizers_set_up_ && sampler_,
                "Trainer::save_checkpoint('", path, "'): nothing to save yet (call fit first)");
  auto& f = *fabric_;
  fabric::FabricState st = make_state();
  state::StateDict loop;
  loop.set("world_size", static_cast<int64_t>(f.world_size()));
  loop.set("batch_size", options_.batch_size);
  loop.set("global_samples", static_cast<int64_t>(sampler_->position()) * f.world_size());
  loop.set("epoch_end_done", epoch_end_done_);
  loop.set("val_pending", val_pending_);
  st.set("loop", loop);
  for (size_t i = 0; i < schedulers_.size(); ++i)
    st.set("scheduler_" + std::to_string(i), schedulers_[i].scheduler->state_dict());
  state::StateDict cbs;
  for (size_t i = 0; i < callbacks_.size(); ++i) {
    state::StateDict s = callbacks_[i]->state_dict();
    if (s.empty()) continue;
    const std::string k = callbacks_[i]->state_key();
    TESSERA_CHECK(!k.empty(), "Trainer::save_checkpoint: callback ", i,
                  " has state but an empty state_key() (override Callback::state_key)");
    cbs.set(k, std::make_shared<state::StateDict>(std::move(s)));
  }
  st.set("callbacks", cbs);
  // Every rank's RNG states (ranks draw different numbers, e.g. dropout).
  state::StateDict rng;
  rng.set("world_size", static_cast<int64_t>(f.world_size()));
  auto cpu = f.comm()->all_gather_bytes(generator_state(at::detail::getDefaultCPUGenerator()));
  for (size_t r = 0; r < cpu.size(); ++r) rng.set("cpu_" + std::to_string(r), state::Bytes{cpu[r]});
  if (f.device().is_cuda()) {
    auto cuda = f.comm()->all_gather_bytes(generator_state(at::globalContext().defaultGenerator(f.device())));
    for (size_t r = 0; r < cuda.size(); ++r) rng.set("cuda_" + std::to_string(r), state::Bytes{cuda[r]});
  }
  st.set("rng", rng);
  state::StateDict extra, hp;
  module_->on_save_checkpoint(extra);
  for (const auto& [k, v] : module_->hparams()) hp.set(k, v);
  st.set("extra", extra).set("hparams", hp);
  std::error_code ec;
  if (f.is_global_zero()) fs::create_directories(fs::path(path).parent_path(), ec);
  f.barrier();
  return st;
}

void Trainer::save_checkpoint(const std::string& path) { write_checkpoint(path, /*async=*/false); }

void Trainer::save_checkpoint_async(const std::string& path) { write_checkpoint(path, /*async=*/true); }

void Trainer::write_checkpoint(const std::string& path, bool async) {
  const auto t0 = std::chrono::steady_clock::now();
  fabric::FabricState st = checkpoint_state(path);  // Fabric waits for a save in flight
  if (async) fabric_->save_async(path, st);
  else fabric_->save(path, st);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ckpt_stats_.saves++ == 0) ckpt_stats_.first_blocking_seconds = seconds;
  ckpt_stats_.blocking_seconds += seconds;
  each_callback([&](Callback& c) { c.on_save_checkpoint(*this, *module_, path); });
}

void Trainer::wait_for_checkpoint() {
  if (fabric_) fabric_->wait_for_checkpoint();
}



std::string Trainer::resolve_ckpt_path(const std::string& ckpt_path) {
  wait_for_checkpoint();  // a last.ckpt still being written counts once it is committed
  if (ckpt_path != "last") return ckpt_path;
  // The newest last.ckpt of the ModelCheckpoint callbacks, chosen on rank zero.
  std::string best;
  if (fabric_->is_global_zero()) {
    fs::file_time_type newest{};
    std::vector<std::string> tried;
    for (auto& c : callbacks_) {
      auto m = std::dynamic_pointer_cast<ModelCheckpoint>(c);
      if (!m) continue;
      const std::string p = m->last_path();
      tried.push_back(p);
      std::error_code ec;
      if (!fs::exists(p, ec)) continue;
      auto t = fs::last_write_time(p, ec);
      if (!ec && (best.empty() || t > newest)) {
        best = p;
        newest = t;
      }
    }
    if (best.empty()) {
      std::string list;
      for (auto& p : tried) list += (list.empty() ? "" : ", ") + p;
      best = "\n" + (tried.empty() ? std::string("no ModelCheckpoint callback (enable_checkpointing is false)") : list);
    }
  }
  best = fabric_->broadcast(best, 0);
  TESSERA_CHECK(best.empty() || best[0] != '\n', "Trainer: ckpt_path \"last\": no last checkpoint exists (looked for ",
                best.substr(1), ")");
  return best;
}

void Trainer::load_checkpoint(const std::string& path, bool weights_only) {
  auto& f = *fabric_;
  TESSERA_CHECK(fs::exists(path), "Trainer: checkpoint '", path, "' does not exist");
  if (weights_only) {
    fabric::FabricState st;
    st.set("model", module_->model_);
    f.load(path, st);
    return;
  }
  fabric::FabricState st = make_state();
  state::StateDict rest = f.load(path, st);
  // Counters read from the file are range-checked before use: an edited checkpoint
  // (re-checksummed) could hold a negative step, or one that overflows the next
  // increment or the sample arithmetic below.
  auto counter = [&](const state::StateDict& sd, const std::string& key, const std::string& name, int64_t lo,
                     int64_t hi) {
    const int64_t v = sd.integer(key);
    TESSERA_CHECK(v >= lo && v <= hi, "Trainer: checkpoint '", path, "' key '", name, "' is ", v, ", outside [", lo,
                  ", ", hi, "] (edited or corrupt checkpoint)");
    return v;
  };
  global_step_ = counter(st.values(), "global_step", "global_step", 0, kMaxCheckpointCounter);
  epoch_ = counter(st.values(), "epoch", "epoch", 0, kMaxCheckpointCounter);

  // The sampler position, translated through global samples when the world size changed.
  state::StateDict ss = st.values().dict("sampler");
  const state::StateDict loop = prefixed_leftovers(rest, "loop");
  counter(ss, "position", "sampler.position", 0, kMaxCheckpointCounter);
  const int64_t saved_w = counter(ss, "num_replicas", "sampler.num_replicas", 1, checkpoint::kMaxWorldSize),
                w = f.world_size();
  if (saved_w != w) {
    const int64_t global = ss.integer("position") * saved_w;
    TESSERA_CHECK(global % w == 0, "Trainer: cannot resume '", path, "' on ", w, " ranks: it stopped after ", global,
                  " samples of epoch ", ss.integer("epoch"), " (", saved_w, " ranks x ", ss.integer("position"),
                  "), which ", w, " ranks cannot split evenly");
    ss.set("num_replicas", w);
    ss.set("position", global / w);
    if (loop.contains("batch_size") && loop.integer("batch_size") * saved_w != options_.batch_size * w && f.is_global_zero())
      std::cerr << "tessera: resuming at world size " << w << " with a global batch of " << options_.batch_size * w
                << " samples; the checkpoint was trained with " << loop.integer("batch_size") * saved_w
                << " (the losses will not match an uninterrupted run)" << std::endl;
  }
  sampler_->load_state(ss);
  if (loop.contains("epoch_end_done")) epoch_end_done_ = loop.boolean("epoch_end_done");
  if (loop.contains("val_pending")) val_pending_ = loop.boolean("val_pending");

  for (size_t i = 0; i < schedulers_.size(); ++i) {
    const std::string key = "scheduler_" + std::to_string(i);
    state::StateDict s = prefixed_leftovers(rest, key);
    TESSERA_CHECK(!s.empty(), "Trainer: checkpoint '", path, "' has no state for LR scheduler ", i, " ('", key,
                  "'); configure_optimizers returned ", schedulers_.size(), " scheduler(s)");
    schedulers_[i].scheduler->load_state_dict(s);
  }
  TESSERA_CHECK(prefixed_leftovers(rest, "scheduler_" + std::to_string(schedulers_.size())).empty(), "Trainer: checkpoint '",
                path, "' holds more LR scheduler states than the ", schedulers_.size(),
                " configure_optimizers returned");

  const state::StateDict cbs = prefixed_leftovers(rest, "callbacks");
  std::map<std::string, state::StateDict> by_key;
  cbs.for_each([&](const std::string& k, const state::Value& v) {
    const size_t dot = k.find('.');
    if (dot == std::string::npos) return;
    by_key[k.substr(0, dot)].set(k.substr(dot + 1), v);
  });
  for (auto& c : callbacks_) {
    const std::string k = c->state_key();
    if (!k.empty() && by_key.count(k)) c->load_state_dict(by_key.at(k));
  }

  const state::StateDict rng = prefixed_leftovers(rest, "rng");
  auto pick = [&](const std::string& kind) -> const state::Bytes* {
    const std::string mine = kind + "_" + std::to_string(f.global_rank());
    if (rng.contains(mine)) return &rng.bytes(mine);
    if (rng.contains(kind + "_0")) return &rng.bytes(kind + "_0");
    return nullptr;
  };
  if (auto b = pick("cpu")) set_generator_state(at::detail::getDefaultCPUGenerator(), b->data);
  if (f.device().is_cuda())
    if (auto b = pick("cuda")) set_generator_state(at::globalContext().defaultGenerator(f.device()), b->data);

  module_->on_load_checkpoint(prefixed_leftovers(rest, "extra"));
  each_callback([&](Callback& c) { c.on_load_checkpoint(*this, *module_, path); });
}

Batch Trainer::make_batch(const TensorData& data, const std::vector<size_t>& idx) const {
  at::Tensor rows = at::tensor(std::vector<int64_t>(idx.begin(), idx.end()), at::kLong);
  const c10::Device dev = fabric_->device();
  return Batch{data.inputs.index_select(0, rows).to(dev), data.targets.index_select(0, rows).to(dev), idx};
}

namespace {

void check_data(const TensorData& d, const char* fn, const char* what, bool allow_empty) {
  if (allow_empty && !d.inputs.defined() && !d.targets.defined()) return;
  TESSERA_CHECK(d.inputs.defined() && d.targets.defined(), fn, ": the ", what, " data has no ",
                d.inputs.defined() ? "targets" : "inputs");
  TESSERA_CHECK(d.inputs.dim() >= 1 && d.targets.dim() >= 1 && d.inputs.size(0) == d.targets.size(0), fn, ": the ",
                what, " inputs have ", d.inputs.dim() ? d.inputs.size(0) : 0, " rows but its targets ",
                d.targets.dim() ? d.targets.size(0) : 0);
  TESSERA_CHECK(allow_empty || d.size() > 0, fn, ": the ", what, " data has no samples");
}

}  // namespace

Metrics Trainer::run_eval(TrainingModule& module, const TensorData& data, const std::string& stage, int64_t nb,
                          bool sanity) {
  auto& f = *fabric_;
  fabric::SamplerOptions so;
  so.shuffle = false;
  fabric::DistributedSampler sampler = f.distributed_sampler(static_cast<size_t>(data.size()), so);
  const size_t ebs = static_cast<size_t>(options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size);
  const bool val = stage == "validate";
  auto model = module.model_.ptr();
  const bool was_training = model->is_training();
  model->eval();
  at::NoGradGuard no_grad;
  RngFork rng(f.device());
  if (!sanity) {
    if (val) {
      module.on_validation_start();
      each_callback([&](Callback& c) { c.on_validation_start(*this, module); });
      module.on_validation_epoch_start();
    } else {
      module.on_test_start();
      each_callback([&](Callback& c) { c.on_test_start(*this, module); });
    }
  }
  if (bar_) bar_->start(sanity ? "sanity" : stage, epoch_, nb);
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
  // Averages: over this rank's samples, and over every rank's for sync_dist names.
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
  Metrics res, shown;
  for (auto& [k, a] : eval_acc_) {
    if (a.weight > 0) res[k] = a.sum / a.weight;
    if (a.weight > 0 && a.prog_bar) shown[k] = res[k];
  }
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
  if (val) {
    module.on_validation_epoch_end();
    module.on_validation_end();
    each_callback([&](Callback& c) { c.on_validation_end(*this, module); });
  } else {
    module.on_test_end();
    each_callback([&](Callback& c) { c.on_test_end(*this, module); });
  }
  return res;
}

int64_t Trainer::eval_batches(const TensorData& data, const BatchCount& limit) const {
  if (data.empty()) return 0;
  const int64_t w = fabric_->world_size();
  const int64_t per_rank = (data.size() + w - 1) / w;
  const int64_t ebs = options_.eval_batch_size > 0 ? options_.eval_batch_size : options_.batch_size;
  return limit.of((per_rank + ebs - 1) / ebs);
}

Metrics Trainer::fit(TrainingModule& module, const TensorData& train, const TensorData& val,
                     const std::string& ckpt_path) {
  TESSERA_CHECK(!fitted_, "Trainer::fit: this Trainer already ran fit; use a new Trainer per fit");
  check_data(train, "Trainer::fit", "training", false);
  check_data(val, "Trainer::fit", "validation", true);
  auto& f = *fabric_;
  attach(module);
  fitted_ = true;
  StageScope scope{&module, stage_};
  stage_ = "fit";
  should_stop_ = false;

  setup_model(module, /*with_optimizers=*/true);
  fabric::SamplerOptions so;
  so.shuffle = options_.shuffle;
  so.seed = options_.seed;
  sampler_ = std::make_unique<fabric::DistributedSampler>(f.distributed_sampler(static_cast<size_t>(train.size()), so));
  setup_loggers(module);

  const int64_t bs = options_.batch_size;
  const int64_t available = (static_cast<int64_t>(sampler_->num_samples()) + bs - 1) / bs;
  num_training_batches_ = options_.limit_train_batches.of(available);
  TESSERA_CHECK(num_training_batches_ > 0, "Trainer::fit: no training batches (TrainerOptions.limit_train_batches ",
                "leaves 0 of ", available, ")");
  const int64_t nval = eval_batches(val, options_.limit_val_batches);
  has_val_ = nval > 0;
  int64_t val_every = 1;
  if (has_val_) {
    if (options_.val_check_interval.batches) {
      val_every = *options_.val_check_interval.batches;
      TESSERA_CHECK(val_every <= num_training_batches_, "TrainerOptions.val_check_interval (", val_every,
                    " batches) is more than the ", num_training_batches_, " training batches of an epoch");
    } else {
      val_every = std::max<int64_t>(1, static_cast<int64_t>(std::floor(options_.val_check_interval.fraction.value_or(1.0) *
                                                                        static_cast<double>(num_training_batches_))));
    }
  }
  each_callback([&](Callback& c) { c.setup(*this, module, "fit"); });  // fit_has_validation() is known
  epoch_end_done_ = val_pending_ = false;
  if (!ckpt_path.empty()) load_checkpoint(resolve_ckpt_path(ckpt_path), /*weights_only=*/false);
  module.global_step_ = global_step_;
  module.epoch_ = epoch_;

  auto done = [&] {
    return should_stop_ || (options_.max_steps >= 0 && global_step_ >= options_.max_steps) ||
           (options_.max_epochs >= 0 && epoch_ >= options_.max_epochs);
  };
  auto validate_now = [&] {
    val_pending_ = false;
    run_eval(module, val, "validate", nval, false);
  };
  // End of a training epoch: hooks, epoch schedulers, callbacks (which may save a
  // checkpoint: epoch_end_done_ tells a resumed run not to repeat them), next epoch.
  auto end_epoch = [&] {
    if (!epoch_end_done_) {
      if (bar_) bar_->finish();
      epoch_end_done_ = true;
      module.on_train_epoch_end(epoch_);
      step_schedulers("epoch");
      each_callback([&](Callback& c) { c.on_train_epoch_end(*this, module); });
    }
    epoch_end_done_ = false;
    ++epoch_;
    module.epoch_ = epoch_;
    sampler_->set_epoch(epoch_);
  };
  auto show = [&](int64_t batch_idx) {
    if (!bar_) return;
    Metrics shown = progress_bar_metrics_;
    if (callback_metrics_.count("train_loss")) shown["loss"] = callback_metrics_.at("train_loss");
    bar_->update(batch_idx, global_step_, shown);
  };
  const int64_t k = options_.accumulate_grad_batches;
  try {
    module.on_fit_start();
    each_callback([&](Callback& c) { c.on_fit_start(*this, module); });
    if (options_.num_sanity_val_steps > 0 && has_val_ && ckpt_path.empty())
      run_eval(module, val, "validate", std::min(nval, options_.num_sanity_val_steps), /*sanity=*/true);
    module.on_train_start();
    each_callback([&](Callback& c) { c.on_train_start(*this, module); });
    if (val_pending_) validate_now();  // the checkpoint was saved between a batch and its validation
    while (!done()) {
      if (epoch_end_done_) {
        end_epoch();
        continue;
      }
      if (sampler_->position() == 0) sampler_->set_epoch(epoch_);  // a resumed epoch keeps its position
      module.epoch_ = epoch_;
      int64_t batch_idx = static_cast<int64_t>(sampler_->position()) / bs;
      if (batch_idx < num_training_batches_) {  // not a resumed epoch whose batches are all done
        module.on_train_epoch_start(epoch_);
        each_callback([&](Callback& c) { c.on_train_epoch_start(*this, module); });
        if (bar_) bar_->start("train", epoch_, num_training_batches_, options_.max_steps);
      }
      double loss_sum = 0;
      while (!done() && batch_idx < num_training_batches_) {
        c10::optional<std::vector<size_t>> idx = sampler_->next(static_cast<size_t>(bs));
        if (!idx) break;
        Batch b = make_batch(train, *idx);
        // The optimizer step this micro-batch belongs to: batches [group_start, group_end).
        const int64_t group_start = batch_idx / k * k;
        const int64_t group = std::min(group_start + k, num_training_batches_) - group_start;
        const bool last = batch_idx + 1 == group_start + group;
        optimizer_stepped_ = false;
        module.global_step_ = global_step_;
        module.on_train_batch_start(b, batch_idx);
        each_callback([&](Callback& c) { c.on_train_batch_start(*this, module, b, batch_idx); });
        at::Tensor loss = module.training_step(b, batch_idx);
        TESSERA_CHECK(loss.defined() && loss.numel() == 1, "TrainingModule::training_step must return a scalar loss");
        {
          fabric::NoBackwardSync no_sync = f.no_backward_sync(module.model_, /*enabled=*/!last);
          at::Tensor scaled = group > 1 ? loss / static_cast<double>(group) : loss;
          module.on_before_backward(scaled);
          each_callback([&](Callback& c) { c.on_before_backward(*this, module, scaled); });
          f.backward(scaled);
          module.on_after_backward();
          each_callback([&](Callback& c) { c.on_after_backward(*this, module); });
        }
        loss_sum += loss.detach().to(at::kCPU).to(at::kDouble).item<double>();
        if (last) {
          for (auto& o : optimizers_) {
            module.on_before_optimizer_step(*o);
            each_callback([&](Callback& c) { c.on_before_optimizer_step(*this, module, *o); });
          }
          if (options_.gradient_clip_val) {
            if (options_.gradient_clip_algorithm == "norm") f.clip_grad_norm(*options_.gradient_clip_val);
            else f.clip_grad_value(*options_.gradient_clip_val);
          }
          for (auto& o : optimizers_) {
            f.step(o);
            module.on_before_zero_grad(*o);
            o->zero_grad();
          }
          ++global_step_;
          module.global_step_ = global_step_;
          step_schedulers("step");
          optimizer_stepped_ = true;
          const double train_loss = f.all_reduce(loss_sum / static_cast<double>(group), distributed::ReduceOp::Avg);
          loss_sum = 0;
          step_metrics_["train_loss"] = train_loss;
          callback_metrics_["train_loss"] = train_loss;
          if (global_step_ % options_.log_every_n_steps == 0) log_to_loggers(step_metrics_, global_step_);
          step_metrics_.clear();
        }
        show(batch_idx);
        val_pending_ = has_val_ && last && (epoch_ + 1) % options_.check_val_every_n_epoch == 0 &&
                       (batch_idx + 1) / val_every > group_start / val_every;
        module.on_train_batch_end(loss, b, batch_idx);
        each_callback([&](Callback& c) { c.on_train_batch_end(*this, module, loss, b, batch_idx); });
        optimizer_stepped_ = false;
        ++batch_idx;
        if (val_pending_) {
          validate_now();
          show(batch_idx - 1);  // the new validation metrics on the training line
        }
      }
      if (batch_idx >= num_training_batches_ || sampler_->position() >= sampler_->num_samples()) end_epoch();
      else if (bar_) bar_->finish();
    }
    module.on_train_end();
    each_callback([&](Callback& c) { c.on_train_end(*this, module); });
    wait_for_checkpoint();  // fit returns with every checkpoint committed (or its error)
    for (auto& l : loggers_) l->finalize();
    module.on_fit_end();
    each_callback([&](Callback& c) { c.on_fit_end(*this, module); });
    each_callback([&](Callback& c) { c.teardown(*this, module, "fit"); });
  } catch (const std::exception& e) {
    for (auto& c : callbacks_) {
      try {
        c->on_exception(*this, module, e);
      } catch (...) {
      }
    }
    throw;
  }
  return callback_metrics_;
}

Metrics Trainer::validate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path) {
  return evaluate(module, data, ckpt_path, "validate");
}

Metrics Trainer::test(TrainingModule& module, const TensorData& data, const std::string& ckpt_path) {
  return evaluate(module, data, ckpt_path, "test");
}

Metrics Trainer::evaluate(TrainingModule& module, const TensorData& data, const std::string& ckpt_path,
                          const std::string& stage) {
  const std::string fn = "Trainer::" + stage;
  check_data(data, fn.c_str(), stage == "test" ? "test" : "validation", false);
  TESSERA_CHECK(stage_.empty(), fn, ": called during ", stage_);
  attach(module);
  StageScope scope{&module, stage_};
  stage_ = stage;
  setup_model(module, /*with_optimizers=*/false);
  setup_loggers(module);
  each_callback([&](Callback& c) { c.setup(*this, module, stage); });
  if (!ckpt_path.empty()) load_checkpoint(resolve_ckpt_path(ckpt_path), /*weights_only=*/true);
  const int64_t nb = eval_batches(data, stage == "test" ? options_.limit_test_batches : options_.limit_val_batches);
  Metrics r = run_eval(module, data, stage, nb, false);
  for (auto& l : loggers_) l->finalize();
  each_callback([&](Callback& c) { c.teardown(*this, module, stage); });
  return r;
}

}  // namespace tessera::trainer
