// Module state dicts: parameters, buffers and the ShardedTensors registered on a
// torch::nn::Module or any of its submodules, under fully-qualified names.
//
// Registration lives in a side registry keyed by module address (works on any
// module, stock ones included, with no base class). An entry dies with its module:
// the registry holds a weak reference taken from the module's shared_ptr owner
// (every module made by std::make_shared, a ModuleHolder or register_module has
// one) and drops entries whose module is gone. A module that is never owned by a
// shared_ptr (a plain stack object) must call clear_sharded_tensors(*this) in its
// destructor; otherwise a later module at the same address would inherit them.
// Module::clone() does not copy registrations.
//
// A "sharded parameter" is a parameter whose name on its module equals the name of a
// ShardedTensor registered there and which IS (same TensorImpl) that tensor's only
// local shard: optimizers see the local shard, state dicts see the ShardedTensor.
#pragma once
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/distributed/communicator.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/state_dict.h"

namespace tessera::state {

// Registers (or replaces) `tensor` under `name` (no dots) on `module`. If the module
// has a parameter or buffer of that name it must be `tensor`'s only local shard.
void register_sharded_tensor(torch::nn::Module& module, const std::string& name, sharding::ShardedTensor tensor);

// Registers `tensor` and its only local shard as the parameter `name` of `module`
// (so optimizers update the local shard). Returns the parameter.
at::Tensor register_sharded_parameter(torch::nn::Module& module, const std::string& name,
                                      sharding::ShardedTensor tensor, bool requires_grad = true);

// The tensor registered under `name` directly on `module` (a handle sharing its
// shards), or nullopt.
std::optional<sharding::ShardedTensor> find_sharded_tensor(const torch::nn::Module& module, const std::string& name);
// Registered tensors of `module` (and, with recurse, its submodules) under FQNs.
std::vector<std::pair<std::string, sharding::ShardedTensor>> named_sharded_tensors(const torch::nn::Module& module,
                                                                                  bool recurse = true);
bool unregister_sharded_tensor(torch::nn::Module& module, const std::string& name);
void clear_sharded_tensors(const torch::nn::Module& module);

// For a parameter that is the local shard of a registered ShardedTensor (a sharded
// parameter, see above): that tensor. Looked up by FQN below `root`.
struct ParamInfo {
  std::string fqn;
  at::Tensor param;
  std::optional<sharding::ShardedTensor> sharded;  // set for sharded parameters
};
std::vector<ParamInfo> named_parameters_info(const torch::nn::Module& root);

// Parameters, buffers (undefined ones skipped) and registered ShardedTensors of
// `module` and its submodules, pre-order (a module's own entries, then each child's),
// under FQNs. Tensors are detached aliases of the module's (no copy); a sharded
// parameter appears once, as its ShardedTensor.
StateDict state_dict(const torch::nn::Module& module);

// A deep copy: tensors and local shards cloned, nested dicts copied (state dicts
// returned by state_dict()/optimizer_state_dict() alias the live tensors).
StateDict clone_state_dict(const StateDict& sd);

struct LoadOptions {
  bool strict = true;
  // Let a sharded value with a different layout (or a sharded value for a replicated
  // tensor) be resharded into place. This runs collectives: every rank must load
  // state dicts with the same keys and kinds.
  bool allow_reshard = false;
};

struct LoadReport {
  std::vector<std::string> missing;     // in the module, not in the state dict
  std::vector<std::string> unexpected;  // in the state dict, not in the module
  std::vector<std::string> mismatched;  // "key: why" (shape, dtype, kind, sharding)
  std::vector<std::string> loaded;      // keys restored
  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  std::string to_string() const;
};

// Restores every entry of state_dict(module) from `sd`, in place. Everything is
// checked before anything is written. Strict: any missing key, unexpected key or
// mismatch throws ONE tessera::Error listing all of them and the module is left
// untouched. Non-strict: mismatched entries are skipped, the rest is loaded, and the
// report lists what was skipped. A plain tensor loads into a ShardedTensor of the
// same global shape (each rank copies its boxes; no communication).
LoadReport load_state_dict(torch::nn::Module& module, const StateDict& sd, const LoadOptions& options);
LoadReport load_state_dict(torch::nn::Module& module, const StateDict& sd, bool strict = true);

// --- configure_model hook -------------------------------------------------------
// A module that creates its sharded tensors (or anything else that needs the
// distributed world) once the world is known. Inherit next to torch::nn::Module.
class ConfigurableModel {
 public:
  virtual ~ConfigurableModel() = default;
  virtual void configure_model(const std::shared_ptr<distributed::Communicator>& comm) = 0;
  bool model_configured() const { return configured_; }

 private:
  friend int configure_model(torch::nn::Module& root, const std::shared_ptr<distributed::Communicator>& comm);
  bool configured_ = false;
};

// Walks `root` pre-order and calls configure_model on every ConfigurableModel that has
// not been configured yet (children a module creates in its configure_model are
// visited too). Idempotent. Returns how many modules were configured by this call.
int configure_model(torch::nn::Module& root, const std::shared_ptr<distributed::Communicator>& comm);

}  // namespace tessera::state
