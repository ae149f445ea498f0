// What a strategy needs to know of a tensor-parallel model (parallel/tensor_parallel.h):
// which parameters are pieces of larger tensors, over which group, and how the state
// dicts and the gradient norm account for them. Internal to the strategy layer.
//  - Full state dicts hold the global tensors under the plain model's FQNs: each cut
//    parameter (and each optimizer state tensor of its shape) is all-gathered over the
//    tensor-parallel group and reassembled (TpCut::assemble).
//  - Loading takes global tensors (plain, or ShardedTensors of any layout) and keeps this
//    rank's piece.
//  - Sharded state dicts hold each cut parameter (and each optimizer state tensor of its
//    layout) as a ShardedTensor of the global shape with a Tp layout (sharding/layout.h),
//    whose local shards are views of this rank's data, one per stripe: over the tensor-
//    parallel group when the parameter is whole on each rank (DDP, one process: inner rule
//    whole; the data-parallel replicas are the save's replica groups), over the mesh's
//    world when FSDP cuts it over the data-parallel group (inner rule FSDP's flat cut).
//    The replicated parameters stay as the strategy holds them.
//  - The gradient norm sums the squares of cut parameters over the group and counts the
//    replicated ones once.
#pragma once
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "tessera/parallel/tensor_parallel.h"
#include "tessera/state/state_dict.h"

namespace tessera::strategy::detail {

class TpView {
 public:
  TpView() = default;
  // The cut parameters under `root` (looking through WrappedModule and FsdpUnit); throws
  // naming two FQNs when they are cut over different groups.
  explicit TpView(const torch::nn::Module& root);
  bool any() const { return comm_ != nullptr; }
  // Whether some cut gives the ranks pieces of different sizes.
  bool any_uneven() const;
  const std::vector<parallel::TpParam>& params() const { return params_; }
  const std::shared_ptr<distributed::Communicator>& comm() const { return comm_; }
  // Whether `p` (a parameter of the model, compared by identity) is cut.
  bool is_cut(const at::Tensor& p) const { return impls_.count(p.unsafeGetTensorImpl()) > 0; }

  // Full module / optimizer state dicts (every tensor plain and TP-local): the cut entries
  // become global tensors. Collective over the group.
  void to_global(state::StateDict& module_sd) const;
  void optimizer_to_global(state::StateDict& optimizer_sd) const;
  // Sharded state dicts (the strategy's sharded form, every cut entry TP-local: a plain
  // tensor or FSDP's ShardedTensor over `dp`) to the 2-D form above. `world` is
  // the mesh's communicator (dp-major: world rank = dp rank · tp + tp rank); null is
  // refused when FSDP cuts a parameter. Throws naming the parameter when a tensor-parallel
  // cut is uneven while FSDP cuts over dp (the replicated parameters' FSDP cut then differs
  // between tp ranks: a Full state dict holds such a model).
  void to_sharded(state::StateDict& module_sd, const std::shared_ptr<distributed::Communicator>& world,
                  const std::shared_ptr<distributed::Communicator>& dp) const;
  void optimizer_to_sharded(state::StateDict& optimizer_sd, const std::shared_ptr<distributed::Communicator>& world,
                            const std::shared_ptr<distributed::Communicator>& dp) const;
  // Loading, into a copy: each cut entry becomes this rank's data. A value of the 2-D form
  // on this mesh gives its local shards (a plain tensor, or a ShardedTensor over `dp` with
  // FSDP's rule); any other (a global tensor, a ShardedTensor of any other layout) is made
  // whole (a collective over its communicator) and this rank's piece is kept.
  state::StateDict to_local(const state::StateDict& module_sd, const std::shared_ptr<distributed::Communicator>& dp) const;
  state::StateDict optimizer_to_local(const state::StateDict& optimizer_sd,
                                      const std::shared_ptr<distributed::Communicator>& dp) const;

  // Sum (or max, for the inf norm) of |g|^p over the cut parameters' local pieces, reduced
  // over the group, plus that of the replicated ones.
  double combine_norm(double cut_part, double replicated_part, bool inf) const;

 private:
  at::Tensor gather(const at::Tensor& local, const parallel::TpCut& cut) const;
  at::Tensor localize(const state::Value& v, const parallel::TpCut& cut, const std::string& key) const;
  // One value (TP-local) to the 2-D form, or nullopt when it is not of the parameter's
  // local shape; and back (nullopt: not of the 2-D form on this mesh).
  std::optional<state::Value> to_2d(const state::Value& v, const parallel::TpParam& p,
                                    const std::shared_ptr<distributed::Communicator>& world,
                                    const std::shared_ptr<distributed::Communicator>& dp) const;
  std::optional<state::Value> from_2d(const state::Value& v, const parallel::TpParam& p,
                                      const std::shared_ptr<distributed::Communicator>& dp) const;
  state::Value local_value(const state::Value& v, const parallel::TpParam& p, const std::string& key,
                           const std::shared_ptr<distributed::Communicator>& dp) const;
  std::vector<parallel::TpParam> params_;
  std::shared_ptr<distributed::Communicator> comm_;
  std::set<const c10::TensorImpl*> impls_;
};

}  // namespace tessera::strategy::detail
