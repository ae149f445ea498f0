// Fully sharded data parallel for libtorch modules (see docs/fsdp.md).
//
// Every parameter is sharded on its own along dim 0 by torch.chunk's rule over the
// shard group (uneven sizes, empty shards allowed). The module's parameter tensors
// keep their identity: Tensor::set_data points them at the gathered full tensor while
// their unit computes and at the local fp32 shard otherwise, so optimizers built over
// module->parameters() step on shards and keep 1/N of the state.
//
// libtorch modules have no forward hooks, so units are explicit: an FsdpUnit module
// wraps a submodule (its FQNs are unchanged: the wrapper registers the wrapped
// module's parameters, buffers and children as its own). Units come from
//  - the user: `register_module("block", FsdpUnit(Block(...)))`, or
//    `strategy.init_module([&]{ return AnyModule(Block(...)); })` (built and
//    sharded at once: deferred, unit-by-unit initialization);
//  - the wrap policy, applied to the children of every torch::nn::Sequential;
//  - setup(), which always makes the root a unit.
// A unit's forward all-gathers its shards (one collective per unit), runs, and frees
// the full tensors (FULL_SHARD); a custom autograd function on its output re-gathers
// before the unit's backward; a hook on each parameter's gradient accumulator
// reduce-scatters the unit's gradients (averaged once) as soon as all are ready. Whether
// those collectives overlap computation depends on the transport (communicator.h).
#pragma once
#include <torch/nn/modules/container/any.h>
#include <torch/nn/pimpl.h>

#include <optional>

#include "tessera/strategy/strategy.h"

namespace tessera::strategy {

enum class ShardingStrategy {
  FullShard,    // shard params, grads, optimizer state; free gathered params after forward
  ShardGradOp,  // same, but keep gathered params from forward until the unit's backward
  NoShard,      // replicate (like DDP) with all-reduce of gradients
  HybridShard,  // FULL_SHARD inside a node group, replicate across node groups
};
const char* to_string(ShardingStrategy s);

struct MixedPrecision {
  // Dtype of the gathered compute parameters (e.g. at::kBFloat16); nullopt: fp32.
  // Master shards and optimizer state stay fp32.
  std::optional<at::ScalarType> param_dtype;
  // Dtype gradients are reduced in; nullopt: fp32.
  std::optional<at::ScalarType> reduce_dtype;
  // The root unit's output is cast to this dtype (floating outputs only).
  at::ScalarType output_dtype = at::kFloat;
};

// Decides whether a child module of a torch::nn::Sequential becomes its own unit.
// `numel` counts the parameters the child holds outside units it already contains.
using WrapPolicy = std::function<bool(const torch::nn::Module& module, int64_t numel)>;
WrapPolicy wrap_by_size(int64_t min_numel);
WrapPolicy wrap_all();
template <typename M>
WrapPolicy wrap_by_type() {
  return [](const torch::nn::Module& m, int64_t) { return dynamic_cast<const M*>(&m) != nullptr; };
}

struct FsdpOptions {
  ShardingStrategy sharding = ShardingStrategy::FullShard;
  // HybridShard: ranks per shard group ("node"); 0: the launcher's LOCAL_WORLD_SIZE.
  int ranks_per_node = 0;
  MixedPrecision mixed_precision;
  // Keep shards, gradients and optimizer state on the CPU and gather to `device`.
  bool cpu_offload = false;
  c10::Device device = c10::kCPU;
  // Recompute each non-root unit's forward during its backward (saves activations).
  // The unit's forward must be deterministic (no dropout RNG replay).
  bool activation_checkpointing = false;
  // Issue the next unit's all-gather early (forward: next in the recorded order;
  // backward: the previous one). On Gloo and NCCL it runs while the current unit
  // computes; over the shared-memory channel it completes when issued (an early gather,
  // no overlap).
  bool prefetch = true;
  // Broadcast every unit's parameters and buffers from rank 0 before sharding them.
  bool sync_module_states = true;
  // Applied to the children of torch::nn::Sequential containers; null: no auto-wrap.
  WrapPolicy auto_wrap;
};

class FsdpStrategy;

class FsdpUnitImpl : public WrappedModuleImpl {
 public:
  explicit FsdpUnitImpl(torch::nn::AnyModule inner);
  explicit FsdpUnitImpl(torch::nn::Sequential inner);
  at::Tensor forward(const at::Tensor& x);
  // Set by the strategy that manages this unit.
  FsdpStrategy* strategy = nullptr;
  int unit_index = -1;
};
TORCH_MODULE(FsdpUnit);

class FsdpStrategy : public Strategy {
 public:
  explicit FsdpStrategy(std::shared_ptr<distributed::Communicator> comm, FsdpOptions options = {});
  ~FsdpStrategy() override;
  std::string name() const override { return "fsdp"; }

  using Strategy::setup;
  torch::nn::AnyModule setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers = {}) override;
  // Builds one unit and shards it immediately (returns an AnyModule holding an FsdpUnit).
  torch::nn::AnyModule init_module(const std::function<torch::nn::AnyModule()>& build) override;
  FsdpUnit unit(const std::function<torch::nn::AnyModule()>& build);

  void backward(const at::Tensor& loss) override;
  void optimizer_step(torch::optim::Optimizer& opt) override;
  double clip_grad_norm(double max_norm, double norm_type = 2.0) override;
  // Checkpoints keep the shards as they are: every rank writes and reads its own (a
  // tensor-parallel model's: full, see Strategy).
  static constexpr StateDictType kDefaultStateDictType = StateDictType::Sharded;
  StateDictType default_state_dict_type() const override;


  const FsdpOptions& options() const { return options_; }
  // Group parameters are sharded over, and the group they are replicated over.
  const std::shared_ptr<distributed::Communicator>& shard_comm() const { return shard_comm_; }
  const std::shared_ptr<distributed::Communicator>& replicate_comm() const { return replicate_comm_; }

  // --- introspection (tests, diagnostics) ---
  int num_units() const;
  // FQNs of the parameters each unit manages, in unit order (root last).
  std::vector<std::vector<std::string>> unit_params() const;
  // Bytes of the local fp32 shards and of the shard gradients currently held.
  int64_t local_param_bytes() const;
  int64_t local_grad_bytes() const;
  // Whether any unit currently holds gathered (full) parameters.
  bool any_gathered() const;
  // Collectives issued from prefetch (forward + backward) since setup.
  int64_t prefetches() const;
  // Unit all-gathers issued since construction (none while parameters stay whole).
  int64_t gathers() const;

  // Called by FsdpUnitImpl::forward.
  at::Tensor unit_forward(FsdpUnitImpl& unit, const at::Tensor& x);

  struct Impl;

 protected:
  void prepare_state() override;

 private:
  void register_sharded_params();
  FsdpOptions options_;
  std::shared_ptr<distributed::Communicator> shard_comm_, replicate_comm_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera::strategy
