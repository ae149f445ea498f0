// The Strategy interface Fabric and the Trainer drive, and the single-device
// strategy. A strategy owns how a module's parameters, gradients and optimizer
// state are laid out across ranks:
//  - SingleDeviceStrategy: one process, plain libtorch;
//  - DdpStrategy (ddp.h): replicated parameters, bucketed gradient all-reduce;
//  - FsdpStrategy (fsdp.h): parameters, gradients and optimizer state sharded.
// Typical loop (identical for every strategy):
//   auto model = strategy->setup(torch::nn::AnyModule(net), {opt});
//   at::Tensor loss = loss_fn(model.forward(x), y);
//   strategy->backward(loss);          // never loss.backward() directly
//   strategy->clip_grad_norm(1.0);     // optional, global norm
//   strategy->optimizer_step(*opt); opt->zero_grad();
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/state/state_dict.h"

namespace tessera::strategy {

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

// Whether a state dict holds the local pieces of sharded values (each a
// ShardedTensor under its original name and global shape) or full tensors.
enum class StateDictType { Sharded, Full };

class Strategy;

// A module that is transparent to names: the wrapped module's own parameters,
// buffers and children are registered as its own, so every FQN is what it would be
// without the wrapper; forward(x) calls the wrapped module. Lets a
// torch::nn::Sequential (whose templated forward an AnyModule cannot hold) be set
// up, and is the base of FsdpUnit.
class WrappedModuleImpl : public torch::nn::Module {
 public:
  explicit WrappedModuleImpl(torch::nn::AnyModule module, const std::string& name = "WrappedModule");
  explicit WrappedModuleImpl(torch::nn::Sequential seq, const std::string& name = "WrappedModule");
  at::Tensor forward(const at::Tensor& x) { return run_wrapped(x); }
  void train(bool on = true) override;
  const std::shared_ptr<torch::nn::Module>& wrapped() const { return wrapped_; }
  at::Tensor run_wrapped(const at::Tensor& x) { return fn_(x); }
  // Re-registers the wrapped module's children (after one was replaced in it).
  void refresh_children();

 private:
  void adopt();
  std::shared_ptr<torch::nn::Module> wrapped_;
  std::function<at::Tensor(const at::Tensor&)> fn_;
};
TORCH_MODULE(WrappedModule);

// While alive, backward() accumulates gradients locally without synchronizing them
// (gradient accumulation); the first backward after it ends synchronizes the sum.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(Strategy* s);
  NoSyncGuard(NoSyncGuard&& o) noexcept : s_(o.s_), prev_(o.prev_) { o.s_ = nullptr; }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  ~NoSyncGuard();

 private:
  Strategy* s_;
  bool prev_ = true;
};

class Strategy {
 public:
  // `comm` may be null: a single-process communicator is created.
  explicit Strategy(std::shared_ptr<distributed::Communicator> comm);
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  virtual std::string name() const = 0;

  // --- setup ---
  // Prepares `module` (replication, sharding, wrapping) and remembers the optimizers
  // (built over module->parameters() before or after setup: parameter tensors keep
  // their identity). Returns the module to call forward on. Call once.
  virtual torch::nn::AnyModule setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers = {}) = 0;
  // A Sequential is set up through a WrappedModule (same FQNs).
  torch::nn::AnyModule setup(torch::nn::Sequential seq, std::vector<OptimizerPtr> optimizers = {}) {
    return setup(torch::nn::AnyModule(WrappedModule(std::move(seq))), std::move(optimizers));
  }
  void add_optimizer(OptimizerPtr opt) { optimizers_.push_back(std::move(opt)); }
  const std::vector<OptimizerPtr>& optimizers() const { return optimizers_; }
  // The module passed to setup (its parameters are the ones optimizers see).
  const std::shared_ptr<torch::nn::Module>& module() const { return module_; }
  // Module-init context: builds one piece of a model. FSDP shards its parameters
  // as soon as it is built (so a model far larger than one rank's memory is never
  // materialized whole); the other strategies return it as built.
  virtual torch::nn::AnyModule init_module(const std::function<torch::nn::AnyModule()>& build) { return build(); }

  // --- training step ---
  virtual void backward(const at::Tensor& loss);
  virtual void optimizer_step(torch::optim::Optimizer& opt);
  // Clips gradients so that their global norm (over all parameters on all ranks) is at
  // most max_norm; returns the norm before clipping (identical on every rank).
  virtual double clip_grad_norm(double max_norm, double norm_type = 2.0);
  virtual void clip_grad_value(double clip_value);
  NoSyncGuard no_sync() { return NoSyncGuard(this); }
  bool grad_sync_enabled() const { return sync_grads_; }
  virtual void set_grad_sync(bool enabled) { sync_grads_ = enabled; }

  // --- state ---
  // Module parameters and buffers under their FQNs (tessera::state::state_dict) and,
  // with `with_optimizers`, one nested dict "optim.<i>" per optimizer
  // (tessera::state::optimizer_state_dict, keyed by parameter FQN). Sharded: FSDP
  // parameters and their optimizer state are ShardedTensors under the original FQN
  // and global shape (values alias the live tensors); Full: every ShardedTensor is
  // replaced by its full value, gathered one tensor at a time on every rank.
  virtual state::StateDict state_dict(StateDictType type = StateDictType::Full, bool with_optimizers = true);
  // Loads values from `sd` (full tensors, or ShardedTensors of any layout: resharded,
  // a collective) into the module and the optimizers; returns the keys it did not
  // consume. strict: missing/unexpected/mismatched keys are one error naming them.
  virtual std::vector<std::string> load_state_dict(const state::StateDict& sd, bool strict = true);

  // --- collectives and rank helpers ---
  const std::shared_ptr<distributed::Communicator>& comm() const { return comm_; }
  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }
  bool is_global_zero() const { return rank() == 0; }
  void barrier() { comm_->barrier(); }
  void all_reduce(at::Tensor& t, distributed::ReduceOp op = distributed::ReduceOp::Avg) { comm_->all_reduce(t, op); }
  at::Tensor all_gather(const at::Tensor& t) { return comm_->all_gather(t); }
  void broadcast(at::Tensor& t, int src = 0) { comm_->broadcast(t, src); }
  double reduce_double(double v, distributed::ReduceOp op = distributed::ReduceOp::Avg) { return comm_->all_reduce_double(v, op); }
  // Runs fn on global rank 0 only.
  void rank_zero_only(const std::function<void()>& fn) const {
    if (comm_->rank() == 0) fn();
  }
  void rank_zero_log(const std::string& message) const;

 protected:
  // Brings parameters into their at-rest layout before state dicts (FSDP: reshard).
  virtual void prepare_state() {}
  void set_module(const std::shared_ptr<torch::nn::Module>& m);
  std::shared_ptr<distributed::Communicator> comm_;
  std::shared_ptr<torch::nn::Module> module_;
  std::vector<OptimizerPtr> optimizers_;
  bool sync_grads_ = true;
};

class SingleDeviceStrategy : public Strategy {
 public:
  explicit SingleDeviceStrategy(c10::Device device = c10::kCPU);
  std::string name() const override { return "single_device"; }
  using Strategy::setup;
  torch::nn::AnyModule setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers = {}) override;

 private:
  c10::Device device_;
};

// Helpers shared by the strategies.
namespace detail {
// Parameters of `m` with FQNs; throws naming both names when one tensor is
// registered under two names (tied weights) and `refuse_tied` is set.
std::vector<std::pair<std::string, at::Tensor>> named_params(const torch::nn::Module& m, bool refuse_tied,
                                                              const std::string& who);
}  // namespace detail

}  // namespace tessera::strategy
