// Fabric: the low-level user API over a strategy. The user writes the loop; Fabric
// starts the processes, sets up the model and optimizers for the chosen strategy,
// and provides backward, clipping, accumulation, collectives and checkpoints.
//
//   fabric::FabricOptions o;
//   o.strategy = "fsdp"; o.devices = 2;
//   fabric::Fabric fabric(o);
//   fabric.launch();                       // re-runs this program on 2 ranks if needed
//   auto model = fabric.setup(torch::nn::AnyModule(net), {opt});
//   for (...) {
//     at::Tensor loss = loss_fn(model.forward(x), y);
//     fabric.backward(loss);
//     fabric.step(opt);
//     opt->zero_grad();
//   }
//   fabric.save("ckpt", FabricState().set("model", net).set("optimizer", opt));
//
// See docs/fabric.md for the complete example (examples/fabric_mlp/main.cpp).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/world.h"
#include "tessera/fabric/fabric_state.h"
#include "tessera/fabric/options.h"
#include "tessera/fabric/sampler.h"
#include "tessera/parallel/mesh.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/strategy/strategy.h"

namespace tessera::fabric {

using OptimizerPtr = strategy::OptimizerPtr;

// While alive, backward() accumulates gradients locally (no gradient communication);
// the first backward after it ends synchronizes the accumulated sum.
class NoBackwardSync {
 public:
  NoBackwardSync() = default;
  explicit NoBackwardSync(strategy::Strategy* s) : guard_(std::make_unique<strategy::NoSyncGuard>(s)) {}
  bool active() const { return guard_ != nullptr; }

 private:
  std::unique_ptr<strategy::NoSyncGuard> guard_;
};

// Enables autocast (the configured dtype, on the configured accelerator) while alive;
// does nothing for precision "32". Nestable.
class AutocastGuard {
 public:
  AutocastGuard() = default;
  AutocastGuard(bool cuda, at::ScalarType dtype);
  AutocastGuard(AutocastGuard&& o) noexcept;
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;
  ~AutocastGuard();

 private:
  bool active_ = false, cuda_ = false, prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

// Gradient clipping: exactly one of max_norm / max_value.
struct GradClip {
  std::optional<double> max_norm;   // global norm over every parameter on every rank
  std::optional<double> max_value;  // clamp each gradient element to [-v, v]
  double norm_type = 2.0;
  // A non-finite total norm is an error (instead of scaling gradients by NaN).
  bool error_if_nonfinite = true;
};

class Fabric {
 public:
  // Validates the options (tessera::Error naming the option); runs no torch op.
  explicit Fabric(FabricOptions options = {});
  ~Fabric();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // When this process was not started by a launcher and devices > 1: runs this program
  // (/proc/self/exe, same arguments) `devices` times as ranks with the torchrun
  // environment, waits for them and exits this process with their exit code (never
  // returns). Otherwise (a rank, or one process): creates the communicator and the
  // strategy and returns. Call before any torch op. Idempotent.
  void launch();
  bool launched() const { return strategy_ != nullptr; }

  // --- setup ---
  // Prepares the module for the strategy (device, replication/sharding) and returns
  // the module to call forward on. Optimizers may be built over the original module's
  // parameters before or after (parameter tensors keep their identity). Once per Fabric.
  torch::nn::AnyModule setup_module(torch::nn::AnyModule module);
  template <typename M>
  torch::nn::AnyModule setup_module(torch::nn::ModuleHolder<M> module) {
    return setup_module(torch::nn::AnyModule(std::move(module)));
  }
  // A Sequential (whose templated forward an AnyModule cannot hold) is set up through a
  // strategy::WrappedModule with the same FQNs; `seq` itself stays usable in
  // FabricState and no_backward_sync.
  torch::nn::AnyModule setup_module(torch::nn::Sequential seq);
  torch::nn::AnyModule setup(torch::nn::AnyModule module, std::vector<OptimizerPtr> optimizers);
  torch::nn::AnyModule setup(torch::nn::Sequential seq, std::vector<OptimizerPtr> optimizers);
  template <typename M>
  torch::nn::AnyModule setup(torch::nn::ModuleHolder<M> module, std::vector<OptimizerPtr> optimizers) {
    return setup(torch::nn::AnyModule(std::move(module)), std::move(optimizers));
  }
  // Registers optimizers (after setup_module) so save/load and step know them.
  void setup_optimizers(const std::vector<OptimizerPtr>& optimizers);
  OptimizerPtr setup_optimizer(OptimizerPtr optimizer);
  // Builds a piece of the model under the strategy's init context: FSDP makes it a unit
  // and shards it as soon as `build` returns, so a model built piece by piece never
  // exists whole on any rank (per-rank peak: its shards, the largest piece, the runtime).
  // Lightning's `empty_init` has no counterpart: libtorch modules initialise their
  // parameters in their constructors and C++ has no meta-device context to skip that.
  torch::nn::AnyModule init_module(const std::function<torch::nn::AnyModule()>& build);

  // --- training step ---
  void backward(const at::Tensor& loss);
  // optimizer.step() through the strategy (FSDP steps on its shards).
  void step(torch::optim::Optimizer& optimizer);
  void step(const OptimizerPtr& optimizer) { step(*optimizer); }
  // Returns the total gradient norm before clipping for max_norm (the same on every
  // rank), nullopt for max_value.
  std::optional<double> clip_gradients(const GradClip& clip);
  double clip_grad_norm(double max_norm, double norm_type = 2.0);
  void clip_grad_value(double max_value);
  // Gradient accumulation: backward() inside the guard does not communicate. `module`
  // must be the module given to setup; enabled=false returns an inactive guard.
  NoBackwardSync no_backward_sync(const torch::nn::AnyModule& module, bool enabled = true);
  NoBackwardSync no_backward_sync(const std::shared_ptr<torch::nn::Module>& module, bool enabled = true);
  // Autocast for the configured precision; wrap the forward pass in it.
  AutocastGuard autocast() const;

  // --- data ---
  // Over the data-parallel ranks: the ranks of one tensor-parallel group get the same
  // indices (with tensor_parallel_size 1, every rank its own).
  DistributedSampler distributed_sampler(size_t dataset_size, SamplerOptions options = {}) const;

  // --- randomness ---
  // Seeds torch's default generator and std::srand; with rank_aware the seed is
  // seed + global_rank (different dropout/augmentation per rank). Returns the seed used.
  uint64_t seed_everything(uint64_t seed, bool rank_aware = false);

  // --- ranks and collectives ---
  int global_rank() const;
  int local_rank() const;
  int node_rank() const;
  int world_size() const;
  bool is_global_zero() const { return global_rank() == 0; }
  // The data-parallel side of the mesh: world_size() / tensor_parallel_size ranks, and
  // this rank's place among them (its batch); the whole world without tensor parallelism.
  int data_parallel_size() const;
  int data_parallel_rank() const;

  // --- the device mesh (docs/tensor-parallel.md) ---
  // ("dp", world / tp) x ("tp", FabricOptions.tensor_parallel_size), tp innermost; the
  // strategy runs over mesh.comm("dp"). After launch().
  const parallel::DeviceMesh& device_mesh() const;
  // What to build the model with: the mesh's tp group and FabricOptions.sequence_parallel
  // (a group of one, or none, without tensor parallelism). After launch(): call it in
  // configure_model / where the model is built.
  parallel::TensorParallel tensor_parallel() const;
  c10::Device device() const;
  // Prints on global rank 0 only (arguments joined with operator<<, newline added).
  template <typename... Args>
  void print(const Args&... args) const {
    if (is_global_zero()) std::cout << concat(args...) << std::endl;
  }
  // Reduced copy of `t` (every rank passes the same shape).
  at::Tensor all_reduce(const at::Tensor& t, distributed::ReduceOp op = distributed::ReduceOp::Avg);
  double all_reduce(double value, distributed::ReduceOp op = distributed::ReduceOp::Avg);
  // Every rank's `t` stacked along a new dim 0 (shape [world_size, ...t.shape]).
  at::Tensor all_gather(const at::Tensor& t);
  // `t` from `src` on every rank (a copy; shapes must match).
  at::Tensor broadcast(const at::Tensor& t, int src = 0);
  std::string broadcast(const std::string& bytes, int src = 0);
  void barrier();

  // --- checkpoints ---
  // Writes the state's module and optimizers (the strategy's typed state) and values to
  // `path`: a sharded directory or one consolidated file, per
  // FabricOptions.state_dict_type (by default the strategy's default_state_dict_type():
  // Sharded for FSDP). A consolidated save has every rank write its rows of the one
  // file (or streams each sharded tensor to rank 0 in bounded slices where the ranks
  // cannot share it), so no rank ever holds more than its shards and a few slices.
  // Waits for an async save in flight first. Collective.
  void save(const std::string& path, const FabricState& state);
  // The same save, written in the background: returns once every rank has copied its
  // part of the state to host memory (training may change the model right away); the
  // files are written and committed (as crash-safely as save()) by a background thread
  // over a communicator of its own. At most one save is in flight: a later save,
  // save_async or load waits for it (and raises its error, on every rank). wait() on the
  // handle (or wait_for_checkpoint()) blocks until it is committed and rethrows its
  // error; ~Fabric waits for it too (and logs an error).
  // Costs one host copy of this rank's state while the write runs. Collective.
  checkpoint::AsyncSave save_async(const std::string& path, const FabricState& state);
  // Blocks until the async save in flight (if any) is committed; rethrows its error.
  void wait_for_checkpoint();
  // Restores every entry of `state` in place from `path` (a sharded directory or a
  // consolidated file, saved at any world size) and returns the plain values in the
  // checkpoint that `state` did not ask for. strict: an entry of `state` missing from
  // the checkpoint, or a tensor under one of its names that the state does not have,
  // is an error naming the keys, and nothing is modified. A requested dict value
  // receives every plain value the checkpoint holds below its name. Collective.
  state::StateDict load(const std::string& path, FabricState& state, bool strict = true);

  // --- access ---
  const ResolvedOptions& options() const { return opts_; }
  const distributed::World& world() const { return world_; }
  strategy::Strategy& strategy();
  const std::shared_ptr<distributed::Communicator>& comm();

 private:
  void require_launched(const char* what) const;
  void check_is_setup_module(const std::shared_ptr<torch::nn::Module>& m, const std::string& what) const;
  int optimizer_index(const torch::optim::Optimizer* opt, const std::string& what) const;
  // A FabricState's entries by kind; each module and optimizer is checked to be this
  // Fabric's (errors start "Fabric::<what>").
  struct StateParts {
    std::vector<std::string> modules, values;
    std::vector<std::pair<std::string, size_t>> optimizers;  // name, index in the strategy
  };
  StateParts parts_of(const FabricState& st, const char* what) const;
  // The strategy's state of the module (when `parts` names one) and of the optimizers
  // `parts` names.
  strategy::StrategyState strategy_state_of(const StateParts& parts, strategy::StateDictType type,
                                            const char* what);
  // The checkpoint save() and save_async() write (the state dict and its save mode).
  std::pair<state::StateDict, checkpoint::SaveOptions> checkpoint_of(const FabricState& st);

  ResolvedOptions opts_;
  distributed::World world_;
  std::shared_ptr<distributed::Communicator> comm_;
  std::unique_ptr<parallel::DeviceMesh> mesh_;
  std::unique_ptr<strategy::Strategy> strategy_;
  std::shared_ptr<torch::nn::Module> setup_original_;
  // The modules that name the set-up model: what was passed, what setup returned, and
  // the modules they wrap.
  std::vector<std::shared_ptr<torch::nn::Module>> setup_aliases_;
  checkpoint::AsyncSave pending_save_;  // the latest save_async
};

}  // namespace tessera::fabric
