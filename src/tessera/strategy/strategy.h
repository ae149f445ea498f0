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
#include "tessera/strategy/strategy_state.h"

namespace tessera::strategy {

using OptimizerPtr = std::shared_ptr<torch::optim::Optimizer>;

class Strategy;
namespace detail {
class TpView;
}

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
  // Typed state (strategy_state.h). Sharded: FSDP parameters and their optimizer state
  // are ShardedTensors under the original FQN and global shape (values alias the live
  // tensors); Full: every ShardedTensor is replaced by its full value, gathered one
  // tensor at a time on every rank (a collective).
  //
  // The kind a checkpoint of this strategy is written in unless the user says otherwise
  // (FSDP: Sharded, the others: Full).
  static constexpr StateDictType kDefaultStateDictType = StateDictType::Full;
  virtual StateDictType default_state_dict_type() const { return kDefaultStateDictType; }
  // Module parameters and buffers under their FQNs (tessera::state::state_dict).
  virtual state::StateDict module_state(StateDictType type = StateDictType::Full);
  // Optimizer `index` (in optimizers()) keyed by parameter FQN
  // (tessera::state::optimizer_state_dict).
  virtual state::StateDict optimizer_state(size_t index, StateDictType type = StateDictType::Full);
  // The module and every optimizer.
  StrategyState state(StateDictType type = StateDictType::Full);
  // The module and the optimizers with the given indices.
  StrategyState state(StateDictType type, const std::vector<size_t>& optimizer_indices);
  // Loads full tensors, or ShardedTensors of any layout (resharded: a collective), into
  // the module; returns the keys it did not consume. strict: missing, unexpected or
  // mismatched keys are one error naming them.
  virtual std::vector<std::string> load_module_state(const state::StateDict& sd, bool strict = true);
  // Loads optimizer `index`'s state (tessera::state::load_optimizer_state_dict).
  virtual void load_optimizer_state(size_t index, const state::StateDict& sd);
  // Loads the module and each optimizer `st` holds; returns the module keys not
  // consumed. strict: also every optimizer must have an entry in `st`.
  std::vector<std::string> load_state(const StrategyState& st, bool strict = true);

  // --- communicator ---
  const std::shared_ptr<distributed::Communicator>& comm() const { return comm_; }
  int rank() const { return comm_->rank(); }

  // --- tensor parallelism (parallel/tensor_parallel.h) ---
  // A model built of tensor-parallel modules over a group of more than one rank is found
  // at setup; the strategy's communicator is then its data-parallel group (the mesh's
  // other dimensions). Its full state dicts hold the global tensors under the plain
  // model's names, its sharded ones each cut parameter as a ShardedTensor of the global
  // shape with a 2-D (tp) layout (docs/tensor-parallel.md), loads keep each rank's piece,
  // and clip_grad_norm counts every element of the global model once.
  // The group the model is cut over (null when it is not), valid after setup.
  std::shared_ptr<distributed::Communicator> tensor_parallel_comm() const;
  // The communicator over every rank of the (dp, tp) mesh whose dp group this strategy
  // runs on, dp-major (world rank = dp rank x tp + tp rank): the sharded state dicts of an
  // FSDP-cut tensor-parallel model span it. Fabric sets it (StrategyOptions::mesh_world).
  void set_mesh_world(std::shared_ptr<distributed::Communicator> world) { mesh_world_ = std::move(world); }

 protected:
  void check_optimizer_index(size_t index, const char* what) const;
  // Brings parameters into their at-rest layout before state dicts (FSDP: reshard).
  virtual void prepare_state() {}
  void set_module(const std::shared_ptr<torch::nn::Module>& m);
  // The tensor-parallel side of the module (internal: strategy/tp_state.h); after setup.
  const detail::TpView& tp_view() const;
  std::shared_ptr<distributed::Communicator> comm_;
  std::shared_ptr<distributed::Communicator> mesh_world_;
  std::shared_ptr<torch::nn::Module> module_;
  std::vector<OptimizerPtr> optimizers_;
  bool sync_grads_ = true;

 private:
  mutable std::unique_ptr<detail::TpView> tp_view_;
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
