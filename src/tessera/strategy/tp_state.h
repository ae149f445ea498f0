// What a strategy needs to know of a tensor-parallel model (parallel/tensor_parallel.h):
// which parameters are pieces of larger tensors, over which group, and how the state
// dicts and the gradient norm account for them. Internal to the strategy layer.
//  - Full state dicts hold the global tensors under the plain model's FQNs: each cut
//    parameter (and each optimizer state tensor of its shape) is all-gathered over the
//    tensor-parallel group and reassembled (TpCut::assemble).
//  - Loading takes global tensors (plain, or ShardedTensors of any layout) and keeps this
//    rank's piece.
//  - The gradient norm sums the squares of cut parameters over the group and counts the
//    replicated ones once.
#pragma once
#include <memory>
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
  const std::vector<parallel::TpParam>& params() const { return params_; }
  const std::shared_ptr<distributed::Communicator>& comm() const { return comm_; }
  // Whether `p` (a parameter of the model, compared by identity) is cut.
  bool is_cut(const at::Tensor& p) const { return impls_.count(p.unsafeGetTensorImpl()) > 0; }

  // Full module / optimizer state dicts (every tensor plain and TP-local): the cut entries
  // become global tensors. Collective over the group.
  void to_global(state::StateDict& module_sd) const;
  void optimizer_to_global(state::StateDict& optimizer_sd) const;
  // The reverse, into a copy: global values of cut entries become this rank's pieces.
  // ShardedTensor values are made whole first (a collective over their communicator).
  state::StateDict to_local(const state::StateDict& module_sd) const;
  state::StateDict optimizer_to_local(const state::StateDict& optimizer_sd) const;

  // Sum (or max, for the inf norm) of |g|^p over the cut parameters' local pieces, reduced
  // over the group, plus that of the replicated ones.
  double combine_norm(double cut_part, double replicated_part, bool inf) const;

 private:
  at::Tensor gather(const at::Tensor& local, const parallel::TpCut& cut) const;
  at::Tensor localize(const state::Value& v, const parallel::TpCut& cut, const std::string& key) const;
  std::vector<parallel::TpParam> params_;
  std::shared_ptr<distributed::Communicator> comm_;
  std::set<const c10::TensorImpl*> impls_;
};

}  // namespace tessera::strategy::detail
