#include "tessera/trainer/callbacks.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <limits>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/error.h"

namespace fs = std::filesystem;

namespace tessera::trainer {

namespace {

std::string no_dots(std::string s) {
  for (auto& c : s)
    if (c == '.') c = '_';
  return s;
}

std::string available(const Metrics& m) {
  std::string out;
  for (const auto& [k, v] : m) out += (out.empty() ? "" : ", ") + k;
  return out.empty() ? "none" : out;
}

std::string format_value(double v, const std::string& fmt, bool integral_name) {
  char buf[64];
  if (fmt.empty()) {
    if (integral_name || (std::isfinite(v) && v == std::floor(v) && std::abs(v) < 1e15))
      std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
    else std::snprintf(buf, sizeof buf, "%.6g", v);
    return buf;
  }
  if (fmt == "d") {
    std::snprintf(buf, sizeof buf, "%lld", static_cast<long long>(v));
    return buf;
  }
  TESSERA_CHECK(fmt.size() >= 3 && fmt[0] == '.' && std::string("feg").find(fmt.back()) != std::string::npos,
                "ModelCheckpoint.filename: unsupported format '", fmt, "' (use .Nf, .Ne, .Ng or d)");
  const std::string digits = fmt.substr(1, fmt.size() - 2);
  TESSERA_CHECK(!digits.empty() && digits.size() <= 2 && digits.find_first_not_of("0123456789") == std::string::npos,
                "ModelCheckpoint.filename: unsupported format '", fmt, "' (use .Nf, .Ne, .Ng or d)");
  const std::string cfmt = "%." + digits + fmt.back();
  std::snprintf(buf, sizeof buf, cfmt.c_str(), v);
  return buf;
}

// Checks the template's syntax (every '{' closed, formats valid) without metrics.
void check_template(const std::string& t) {
  size_t p = 0;
  while ((p = t.find('{', p)) != std::string::npos) {
    const size_t e = t.find('}', p);
    TESSERA_CHECK(e != std::string::npos, "ModelCheckpoint.filename '", t, "': '{' at ", p, " is not closed");
    const std::string field = t.substr(p + 1, e - p - 1);
    const size_t colon = field.find(':');
    TESSERA_CHECK(!field.empty() && colon != 0, "ModelCheckpoint.filename '", t, "': empty metric name at ", p);
    if (colon != std::string::npos) format_value(0.0, field.substr(colon + 1), false);
    p = e + 1;
  }
  TESSERA_CHECK(t.find('/') == std::string::npos, "ModelCheckpoint.filename '", t,
                "' contains a '/' (set ModelCheckpoint.dirpath for the directory)");
}

}  // namespace

// --- ModelCheckpoint ------------------------------------------------------------------

ModelCheckpoint::ModelCheckpoint(ModelCheckpointOptions options) : o_(std::move(options)) {
  TESSERA_CHECK(o_.mode == "min" || o_.mode == "max", "ModelCheckpoint.mode must be \"min\" or \"max\", got \"", o_.mode,
                "\"");
  TESSERA_CHECK(o_.save_top_k >= -1, "ModelCheckpoint.save_top_k must be -1 (all), 0 (none) or k >= 1, got ",
                o_.save_top_k);
  TESSERA_CHECK(!o_.monitor.empty() || o_.save_top_k <= 1, "ModelCheckpoint.save_top_k=", o_.save_top_k,
                " needs ModelCheckpoint.monitor (without a monitor only 0, 1 (the newest) or -1 (all) apply)");
  TESSERA_CHECK(o_.every_n_train_steps >= 0, "ModelCheckpoint.every_n_train_steps must be >= 0, got ",
                o_.every_n_train_steps);
  TESSERA_CHECK(o_.every_n_epochs >= 0, "ModelCheckpoint.every_n_epochs must be >= 0, got ", o_.every_n_epochs);
  if (o_.filename.empty()) o_.filename = "{epoch}-{step}";
  check_template(o_.filename);
}

std::string ModelCheckpoint::state_key() const {
  return no_dots("ModelCheckpoint{monitor=" + o_.monitor + ",mode=" + o_.mode +
                 ",every_n_train_steps=" + std::to_string(o_.every_n_train_steps) +
                 ",every_n_epochs=" + std::to_string(o_.every_n_epochs) + "}");
}

state::StateDict ModelCheckpoint::state_dict() const {
  state::StateDict sd;
  sd.set("dirpath", dirpath_);
  sd.set("monitor", o_.monitor);
  sd.set("best_model_path", best_path_);
  if (best_score_) sd.set("best_model_score", *best_score_);
  sd.set("kth_best_model_path", kth_path_);
  sd.set("last_model_path", last_path_);
  sd.set("last_saved_step", last_saved_step_);
  sd.set("best_k_count", static_cast<int64_t>(best_k_.size()));
  int64_t i = 0;
  for (const auto& [p, s] : best_k_) {
    sd.set("best_k_path_" + std::to_string(i), p);
    sd.set("best_k_score_" + std::to_string(i), s);
    ++i;
  }
  return sd;
}

void ModelCheckpoint::load_state_dict(const state::StateDict& sd) {
  last_saved_step_ = sd.contains("last_saved_step") ? sd.integer("last_saved_step") : -1;
  // Checkpoints ranked in another directory are not this callback's to manage.
  if (!sd.contains("dirpath") || (!dirpath_.empty() && sd.string("dirpath") != dirpath_)) return;
  best_k_.clear();
  const int64_t n = sd.integer("best_k_count");
  for (int64_t i = 0; i < n; ++i)
    best_k_[sd.string("best_k_path_" + std::to_string(i))] = sd.number("best_k_score_" + std::to_string(i));
  best_path_ = sd.string("best_model_path");
  best_score_.reset();
  if (sd.contains("best_model_score")) best_score_ = sd.number("best_model_score");
  kth_path_ = sd.string("kth_best_model_path");
  last_path_ = sd.string("last_model_path");
}

void ModelCheckpoint::setup(Trainer& trainer, TrainingModule&, Stage stage) {
  dirpath_ = o_.dirpath.empty() ? (fs::path(trainer.options().default_root_dir) / "checkpoints").string() : o_.dirpath;
  if (stage == Stage::Fit) fit_has_val_ = trainer.fit_has_validation();
}

void ModelCheckpoint::on_fit_start(Trainer& trainer, TrainingModule&) {
  if (o_.async_save) checkpoint::prepare_async_save(trainer.fabric().comm());
}

std::string ModelCheckpoint::format_name(const Metrics& metrics) const {
  const std::string& t = o_.filename;
  std::string out;
  size_t p = 0;
  while (true) {
    const size_t b = t.find('{', p);
    if (b == std::string::npos) {
      out += t.substr(p);
      break;
    }
    out += t.substr(p, b - p);
    const size_t e = t.find('}', b);
    const std::string field = t.substr(b + 1, e - b - 1);
    const size_t colon = field.find(':');
    const std::string name = field.substr(0, colon);
    const std::string fmt = colon == std::string::npos ? "" : field.substr(colon + 1);
    auto it = metrics.find(name);
    const double v = it == metrics.end() ? 0.0 : it->second;  // Lightning's rule for absent metrics
    if (o_.auto_insert_metric_name) out += name + "=";
    out += format_value(v, fmt, name == "epoch" || name == "step");
    p = e + 1;
  }
  return out;
}

bool ModelCheckpoint::better(double a, double b) const { return o_.mode == "min" ? a < b : a > b; }

std::string ModelCheckpoint::unique_path(Trainer& trainer, const std::string& stem, const std::string& replaces) {
  std::string path;
  if (trainer.is_global_zero()) {
    path = dirpath_ + "/" + stem + ".ckpt";
    for (int v = 1; (fs::exists(path) && path != replaces) || path == last_path(); ++v)
      path = dirpath_ + "/" + stem + "-v" + std::to_string(v) + ".ckpt";
  }
  return trainer.fabric().broadcast(path, 0);
}

void ModelCheckpoint::write(Trainer& trainer, const std::string& path) {
  flush_removals(trainer);
  if (o_.async_save) trainer.save_checkpoint_async(path);
  else trainer.save_checkpoint(path);
}

void ModelCheckpoint::flush_removals(Trainer& trainer) {
  if (pending_removals_.empty()) return;
  trainer.wait_for_checkpoint();
  std::vector<std::string> paths;
  paths.swap(pending_removals_);
  for (auto& p : paths) remove(trainer, p);
}

void ModelCheckpoint::retire(Trainer& trainer, const std::string& path) {
  if (o_.async_save) pending_removals_.push_back(path);  // once its replacement is committed
  else remove(trainer, path);
}

void ModelCheckpoint::remove(Trainer& trainer, const std::string& path) {
  if (path.empty() || path == last_path()) return;
  if (trainer.is_global_zero()) {
    std::error_code ec;
    fs::remove_all(path, ec);  // a file, or a sharded checkpoint's directory
    if (ec) std::cerr << "tessera: ModelCheckpoint could not remove '" << path << "': " << ec.message() << std::endl;
  }
}

void ModelCheckpoint::save(Trainer& trainer, TrainingModule& module) {
  const int64_t step = trainer.global_step();
  if (step == last_saved_step_) return;
  last_saved_step_ = step;
  Metrics m = trainer.rank_zero_metrics();
  m["epoch"] = static_cast<double>(trainer.current_epoch());
  m["step"] = static_cast<double>(step);
  const int64_t k = o_.save_top_k;
  if (k != 0 && o_.monitor.empty()) {
    std::vector<std::string> superseded;
    if (k == 1)
      for (auto& [p, s] : best_k_) superseded.push_back(p);
    const std::string path = unique_path(trainer, format_name(m), superseded.empty() ? "" : superseded.front());
    for (auto& p : superseded) best_k_.erase(p);
    best_k_[path] = static_cast<double>(step);
    best_path_ = kth_path_ = path;
    write(trainer, path);
    for (auto& p : superseded)
      if (p != path) retire(trainer, p);
  } else if (k != 0) {
    auto it = m.find(o_.monitor);
    if (it == m.end()) {
      if (!warned_missing_ && trainer.is_global_zero())
        std::cerr << "tessera: ModelCheckpoint(monitor='" << o_.monitor << "') found no such metric at step " << step
                  << " (logged: " << available(m) << "); no top-k checkpoint saved" << std::endl;
      warned_missing_ = true;
    } else {
      double score = it->second;
      if (std::isnan(score))
        score = o_.mode == "min" ? std::numeric_limits<double>::infinity() : -std::numeric_limits<double>::infinity();
      // The worst kept checkpoint (the one a better score replaces when k are kept).
      std::string worst;
      for (auto& [p, s] : best_k_)
        if (worst.empty() || better(best_k_.at(worst), s)) worst = p;
      const bool keep = k == -1 || static_cast<int64_t>(best_k_.size()) < k || better(score, best_k_.at(worst));
      if (keep) {
        std::string superseded;
        if (k != -1 && static_cast<int64_t>(best_k_.size()) >= k) {
          superseded = worst;
          best_k_.erase(worst);
        }
        // The superseded checkpoint's name may be reused (it is replaced in place).
        const std::string path = unique_path(trainer, format_name(m), superseded);
        best_k_[path] = score;
        best_path_.clear();
        kth_path_.clear();
        for (auto& [p, s] : best_k_) {
          if (best_path_.empty() || better(s, best_k_.at(best_path_))) best_path_ = p;
          if (kth_path_.empty() || better(best_k_.at(kth_path_), s)) kth_path_ = p;
        }
        best_score_ = best_k_.at(best_path_);
        write(trainer, path);
        if (superseded != path) retire(trainer, superseded);
      }
    }
  }
  if (o_.save_last) save_last(trainer);
}

void ModelCheckpoint::save_last(Trainer& trainer) {
  last_path_ = last_path();
  last_saved_last_step_ = trainer.global_step();
  write(trainer, last_path_);
  trainer.set_last_checkpoint_path(last_path_);
}

void ModelCheckpoint::on_train_batch_end(Trainer& trainer, TrainingModule& module, const at::Tensor&, const Batch&,
                                         int64_t) {
  if (!trainer.optimizer_stepped() || o_.every_n_train_steps == 0) return;
  if (trainer.global_step() % o_.every_n_train_steps == 0) save(trainer, module);
}

void ModelCheckpoint::on_validation_end(Trainer& trainer, TrainingModule& module) {
  if (trainer.stage() != Stage::Fit || o_.every_n_train_steps > 0 || o_.every_n_epochs == 0) return;
  if ((trainer.current_epoch() + 1) % o_.every_n_epochs == 0) save(trainer, module);
}

void ModelCheckpoint::on_train_epoch_end(Trainer& trainer, TrainingModule& module) {
  if (fit_has_val_ || o_.every_n_train_steps > 0 || o_.every_n_epochs == 0) return;
  if ((trainer.current_epoch() + 1) % o_.every_n_epochs == 0) save(trainer, module);
}

void ModelCheckpoint::on_train_end(Trainer& trainer, TrainingModule&) {
  if (o_.save_last && last_saved_last_step_ != trainer.global_step()) save_last(trainer);
  flush_removals(trainer);
}

// --- EarlyStopping --------------------------------------------------------------------

EarlyStopping::EarlyStopping(EarlyStoppingOptions options) : o_(std::move(options)) {
  TESSERA_CHECK(!o_.monitor.empty(), "EarlyStopping.monitor is empty");
  TESSERA_CHECK(o_.mode == "min" || o_.mode == "max", "EarlyStopping.mode must be \"min\" or \"max\", got \"", o_.mode,
                "\"");
  TESSERA_CHECK(o_.patience >= 0, "EarlyStopping.patience must be >= 0, got ", o_.patience);
  TESSERA_CHECK(std::isfinite(o_.min_delta) && o_.min_delta >= 0, "EarlyStopping.min_delta must be >= 0, got ",
                o_.min_delta);
}

std::string EarlyStopping::state_key() const {
  return no_dots("EarlyStopping{monitor=" + o_.monitor + ",mode=" + o_.mode + "}");
}

state::StateDict EarlyStopping::state_dict() const {
  state::StateDict sd;
  sd.set("wait_count", wait_);
  sd.set("stopped_epoch", stopped_epoch_);
  sd.set("patience", o_.patience);
  if (best_) sd.set("best_score", *best_);
  return sd;
}

void EarlyStopping::load_state_dict(const state::StateDict& sd) {
  wait_ = sd.integer("wait_count");
  stopped_epoch_ = sd.integer("stopped_epoch");
  best_.reset();
  if (sd.contains("best_score")) best_ = sd.number("best_score");
}

void EarlyStopping::setup(Trainer& trainer, TrainingModule&, Stage stage) {
  if (stage == Stage::Fit) on_train_epoch_end_ = o_.check_on_train_epoch_end.value_or(!trainer.fit_has_validation());
}

void EarlyStopping::on_validation_end(Trainer& trainer, TrainingModule&) {
  if (trainer.stage() == Stage::Fit && !on_train_epoch_end_) check(trainer);
}

void EarlyStopping::on_train_epoch_end(Trainer& trainer, TrainingModule&) {
  if (on_train_epoch_end_) check(trainer);
}

void EarlyStopping::check(Trainer& trainer) {
  const Metrics m = trainer.rank_zero_metrics();  // every rank decides on rank zero's value
  auto it = m.find(o_.monitor);
  if (it == m.end()) {
    TESSERA_CHECK(!o_.strict, "EarlyStopping: the monitored metric '", o_.monitor, "' was not logged (logged: ",
                  available(m), "); log it or set EarlyStoppingOptions.strict = false");
    return;
  }
  const double v = it->second;
  bool stop = false;
  if (o_.check_finite && !std::isfinite(v)) {
    stop = true;
    reason_ = "monitored metric " + o_.monitor + " = " + std::to_string(v) + " is not finite";
  } else if (!best_ || (o_.mode == "min" ? v < *best_ - o_.min_delta : v > *best_ + o_.min_delta)) {
    best_ = v;
    wait_ = 0;
  } else if (++wait_ >= o_.patience) {
    stop = true;
    reason_ = "monitored metric " + o_.monitor + " did not improve in the last " + std::to_string(wait_) +
              " checks; best " + std::to_string(*best_);
  }
  if (stop) {
    stopped_epoch_ = trainer.current_epoch();
    stopped_step_ = trainer.global_step();
    trainer.set_should_stop(true);
    if (trainer.is_global_zero()) std::cerr << "tessera: EarlyStopping: " << reason_ << std::endl;
  }
}

// --- LearningRateMonitor --------------------------------------------------------------

namespace {

std::string optimizer_class(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::AdamW*>(&o)) return "AdamW";
  if (dynamic_cast<const torch::optim::Adam*>(&o)) return "Adam";
  if (dynamic_cast<const torch::optim::SGD*>(&o)) return "SGD";
  if (dynamic_cast<const torch::optim::RMSprop*>(&o)) return "RMSprop";
  if (dynamic_cast<const torch::optim::Adagrad*>(&o)) return "Adagrad";
  if (dynamic_cast<const torch::optim::LBFGS*>(&o)) return "LBFGS";
  return "Optimizer";
}

}  // namespace

std::vector<std::string> LearningRateMonitor::keys(const Trainer& trainer) {
  const auto& opts = trainer.optimizers();
  std::vector<std::string> names;
  for (const auto& o : opts) {
    std::string n = optimizer_class(*o);
    for (const auto& s : trainer.lr_schedulers())
      if (s.scheduler->optimizer() == o && !s.name.empty()) n = s.name;
    names.push_back(n);
  }
  std::vector<std::string> out;
  for (size_t i = 0; i < opts.size(); ++i) {
    std::string n = names[i];
    if (std::count(names.begin(), names.end(), n) > 1) n += "-" + std::to_string(i);
    const size_t groups = opts[i]->param_groups().size();
    for (size_t g = 0; g < groups; ++g) out.push_back("lr-" + n + (groups > 1 ? "/pg" + std::to_string(g) : ""));
  }
  return out;
}

void LearningRateMonitor::on_train_batch_start(Trainer& trainer, TrainingModule& module, const Batch&, int64_t) {
  if (trainer.stage() != Stage::Fit || trainer.global_step() == last_step_) return;
  last_step_ = trainer.global_step();
  const std::vector<std::string> k = keys(trainer);
  size_t i = 0;
  for (const auto& o : trainer.optimizers())
    for (auto& g : o->param_groups()) module.log(k[i++], g.options().get_lr());
}

}  // namespace tessera::trainer
