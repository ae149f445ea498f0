#include "tessera/trainer/lr_scheduler.h"

#include <ATen/ATen.h>

#include <cmath>

#include "tessera/core/error.h"

namespace tessera::trainer {

LRScheduler::LRScheduler(OptimizerPtr optimizer) : optimizer_(std::move(optimizer)) {
  TESSERA_CHECK(optimizer_ != nullptr, "LRScheduler: the optimizer is null");
  for (auto& g : optimizer_->param_groups()) base_lrs_.push_back(g.options().get_lr());
  TESSERA_CHECK(!base_lrs_.empty(), "LRScheduler: the optimizer has no param groups");
}

void LRScheduler::init() { apply(); }

void LRScheduler::apply() {
  auto& groups = optimizer_->param_groups();
  TESSERA_CHECK(groups.size() == base_lrs_.size(), name(), ": the optimizer has ", groups.size(),
                " param groups but the scheduler was built for ", base_lrs_.size());
  for (size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lr_at(base_lrs_[i], count_));
}

void LRScheduler::step() {
  ++count_;
  apply();
}

std::vector<double> LRScheduler::last_lr() const {
  std::vector<double> out;
  for (auto& g : optimizer_->param_groups()) out.push_back(g.options().get_lr());
  return out;
}

state::StateDict LRScheduler::state_dict() const {
  state::StateDict sd;
  sd.set("name", name());
  sd.set("count", count_);
  // Plain numbers (not a tensor): checkpoints give plain values back by name.
  sd.set("groups", static_cast<int64_t>(base_lrs_.size()));
  for (size_t i = 0; i < base_lrs_.size(); ++i) sd.set("base_lr_" + std::to_string(i), base_lrs_[i]);
  return sd;
}

void LRScheduler::load_state_dict(const state::StateDict& sd) {
  TESSERA_CHECK(sd.string("name") == name(), "LRScheduler::load_state_dict: the checkpoint holds a '",
                sd.string("name"), "' state, this scheduler is a ", name());
  const int64_t groups = sd.integer("groups");
  TESSERA_CHECK(groups == static_cast<int64_t>(base_lrs_.size()), name(), "::load_state_dict: the state has ", groups,
                " param groups ('groups'), the optimizer ", base_lrs_.size());
  const int64_t count = sd.integer("count");
  TESSERA_CHECK(count >= 0, name(), "::load_state_dict: 'count' is negative (", count, ")");
  for (size_t i = 0; i < base_lrs_.size(); ++i) base_lrs_[i] = sd.number("base_lr_" + std::to_string(i));
  count_ = count;
  apply();
}

StepLR::StepLR(OptimizerPtr optimizer, int64_t step_size, double gamma)
    : LRScheduler(std::move(optimizer)), step_size_(step_size), gamma_(gamma) {
  TESSERA_CHECK(step_size >= 1, "StepLR: step_size must be at least 1, got ", step_size);
  TESSERA_CHECK(gamma > 0, "StepLR: gamma must be positive, got ", gamma);
  init();
}

double StepLR::lr_at(double base, int64_t count) const {
  return base * std::pow(gamma_, static_cast<double>(count / step_size_));
}

WarmupCosineLR::WarmupCosineLR(OptimizerPtr optimizer, int64_t warmup_steps, int64_t total_steps,
                               double min_lr_ratio)
    : LRScheduler(std::move(optimizer)), warmup_(warmup_steps), total_(total_steps), min_ratio_(min_lr_ratio) {
  TESSERA_CHECK(warmup_steps >= 0, "WarmupCosineLR: warmup_steps must be >= 0, got ", warmup_steps);
  TESSERA_CHECK(total_steps > warmup_steps, "WarmupCosineLR: total_steps (", total_steps,
                ") must be larger than warmup_steps (", warmup_steps, ")");
  TESSERA_CHECK(min_lr_ratio >= 0 && min_lr_ratio <= 1, "WarmupCosineLR: min_lr_ratio must be in [0, 1], got ",
                min_lr_ratio);
  init();
}

double WarmupCosineLR::lr_at(double base, int64_t count) const {
  if (count < warmup_) return base * static_cast<double>(count + 1) / static_cast<double>(warmup_);
  const double p = std::min(1.0, static_cast<double>(count - warmup_) / static_cast<double>(total_ - warmup_));
  return base * (min_ratio_ + (1.0 - min_ratio_) * 0.5 * (1.0 + std::cos(M_PI * p)));
}

LambdaLR::LambdaLR(OptimizerPtr optimizer, std::function<double(int64_t)> factor)
    : LRScheduler(std::move(optimizer)), factor_(std::move(factor)) {
  TESSERA_CHECK(static_cast<bool>(factor_), "LambdaLR: the factor function is empty");
  init();
}

double LambdaLR::lr_at(double base, int64_t count) const { return base * factor_(count); }

}  // namespace tessera::trainer
