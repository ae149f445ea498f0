// Learning-rate schedulers for the Trainer. A scheduler is bound to one optimizer when it
// is constructed (it records each param group's current lr as its base lr, like
// PyTorch's initial_lr) and sets lr = lr_at(base_lr, count) after every step(), where
// count is the number of step() calls so far. The learning rate is a closed-form
// function of the count, so the scheduler's state is {count, base_lrs} and a restored
// scheduler sets the learning rates it would have had.
//
//   auto opt = std::make_shared<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-4));
//   auto sched = std::make_shared<trainer::WarmupCosineLR>(opt, /*warmup_steps=*/100, /*total_steps=*/5000);
//   return trainer::OptimizerConfig(opt, sched);            // stepped after every optimizer step
//   return trainer::OptimizerConfig(opt, sched, trainer::Interval::Epoch);   // or once per epoch
#pragma once
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/state/state_dict.h"

namespace tessera::trainer {

// The optimizer a scheduler drives (the same type as fabric::OptimizerPtr; spelled here
// so this header needs only the optimizer base class, not all of fabric.h).
using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

class LRScheduler {
 public:
  // Records the optimizer's current lr of each param group as the base lrs and applies
  // lr_at(base, 0) (call from the subclass constructor through init()).
  explicit LRScheduler(OptimizerPtr optimizer);
  virtual ~LRScheduler() = default;

  // Advances the count by one and sets every param group's lr.
  void step();
  int64_t count() const { return count_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // The lrs set by the last step() (or at construction / load).
  std::vector<double> last_lr() const;
  const OptimizerPtr& optimizer() const { return optimizer_; }
  virtual std::string name() const = 0;  // "StepLR", "WarmupCosineLR", "LambdaLR"

  // {"name", "count", "groups", "base_lr_<i>"}. load_state_dict checks the
  // name and the number of param groups, then applies the lrs of the restored count.
  state::StateDict state_dict() const;
  void load_state_dict(const state::StateDict& sd);

 protected:
  // The lr of a param group whose base lr is `base` after `count` steps.
  virtual double lr_at(double base, int64_t count) const = 0;
  // Subclasses call this at the end of their constructor (lr_at is virtual).
  void init();

 private:
  void apply();
  OptimizerPtr optimizer_;
  std::vector<double> base_lrs_;
  int64_t count_ = 0;
};
using LRSchedulerPtr = std::shared_ptr<LRScheduler>;

// lr = base * gamma ^ floor(count / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(OptimizerPtr optimizer, int64_t step_size, double gamma = 0.1);
  std::string name() const override { return "StepLR"; }

 protected:
  double lr_at(double base, int64_t count) const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// Linear warmup, then half-cosine decay: lr = base * (count + 1) / warmup_steps while
// count < warmup_steps; then base * (r + (1 - r) * (1 + cos(pi * p)) / 2) with
// p = (count - warmup_steps) / (total_steps - warmup_steps) capped at 1 and r = min_lr_ratio
// (so lr reaches base * r at count == total_steps and stays there).
class WarmupCosineLR : public LRScheduler {
 public:
  WarmupCosineLR(OptimizerPtr optimizer, int64_t warmup_steps, int64_t total_steps, double min_lr_ratio = 0.0);
  std::string name() const override { return "WarmupCosineLR"; }

 protected:
  double lr_at(double base, int64_t count) const override;

 private:
  int64_t warmup_, total_;
  double min_ratio_;
};

// lr = base * factor(count) (PyTorch's LambdaLR; the function must be pure: it is
// re-evaluated after a restore).
class LambdaLR : public LRScheduler {
 public:
  LambdaLR(OptimizerPtr optimizer, std::function<double(int64_t)> factor);
  std::string name() const override { return "LambdaLR"; }

 protected:
  double lr_at(double base, int64_t count) const override;

 private:
  std::function<double(int64_t)> factor_;
};

// When the Trainer steps a scheduler: after every optimizer step (Step) or after each
// training epoch (Epoch).
enum class Interval { Step, Epoch };

// "step", "epoch".
inline const char* to_string(Interval interval) {
  switch (interval) {
    case Interval::Step: return "step";
    case Interval::Epoch: return "epoch";
  }
  return "?";
}

// One scheduler and when the Trainer steps it.
struct SchedulerConfig {
  LRSchedulerPtr scheduler;
  Interval interval = Interval::Step;  // Step: after every optimizer step; Epoch: after each epoch
  int64_t frequency = 1;          // every n steps / epochs
  std::string name;               // LearningRateMonitor key ("lr-<name>"); default: the optimizer's name
};

// What TrainingModule::configure_optimizers returns: the optimizers and, optionally,
// LR schedulers (each bound to one of the optimizers). Converts implicitly from one
// optimizer or a vector of them.
struct OptimizerConfig {
  std::vector<OptimizerPtr> optimizers;
  std::vector<SchedulerConfig> schedulers;

  OptimizerConfig() = default;
  OptimizerConfig(std::vector<OptimizerPtr> opts) : optimizers(std::move(opts)) {}  // NOLINT(implicit)
  template <typename O, typename = std::enable_if_t<std::is_base_of<torch::optim::Optimizer, O>::value>>
  OptimizerConfig(std::shared_ptr<O> opt) : optimizers{std::move(opt)} {}  // NOLINT(implicit)
  template <typename O, typename = std::enable_if_t<std::is_base_of<torch::optim::Optimizer, O>::value>>
  OptimizerConfig(std::shared_ptr<O> opt, LRSchedulerPtr scheduler, Interval interval = Interval::Step,
                  int64_t frequency = 1)
      : optimizers{std::move(opt)}, schedulers{{std::move(scheduler), interval, frequency, ""}} {}
};

}  // namespace tessera::trainer
