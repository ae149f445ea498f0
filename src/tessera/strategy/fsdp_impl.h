// FSDP internals, not a public header: a unit's parameter group (FsdpParamGroup: its
// flat layout and its lifecycle through one training step, fsdp_param_group.cpp) and the
// strategy's Impl, which orchestrates the groups (forward order, prefetch, the end of
// backward: fsdp_runtime.cpp; setup, clipping, state dicts: fsdp.cpp).
#pragma once
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "tessera/strategy/fsdp.h"
#include "tessera/strategy/grad_hooks.h"

namespace tessera::strategy {

struct FsdpParam {
  std::string fqn;
  at::Tensor p;                   // the module's parameter (identity kept)
  std::vector<int64_t> shape;     // global shape
  int64_t rows = 0;               // dim-0 size (1 for a 0-dim parameter)
  int64_t row_numel = 0;          // elements per row
  int64_t local_rows = 0;         // rows of this shard-group rank (the unit's row-aligned cut)
  int64_t row_begin = 0;          // first row of this rank (no list of every rank's rows:
                                  // a rank holds O(1) per parameter at any world size)
  int64_t flat_offset = 0;        // where the parameter starts in the unit's flat vector
  int64_t shard_offset = 0;       // where its local rows start in this rank's stretch
  at::Tensor shard;               // master shard [local rows, shape[1:]...] (a view of the unit's shard_flat)
  at::Tensor full;                // gathered parameter (compute dtype): a view of the unit's full_flat
  at::Tensor stash_grad;          // shard grad held across a forward/backward
  at::Tensor unsynced;            // full-size grad accumulated under no_sync
  at::Tensor new_grad;            // reduced shard grad of this backward
  // Its gradient hook fired in this backward (per parameter, so a second accumulation
  // does not count twice towards the group's ready count).
  bool ready = false;
  detail::AccumulatorHook hook;

  std::vector<int64_t> shard_shape(int64_t local_rows) const;
};

class FsdpParamGroup;

// What the parameter groups of one strategy share at run time.
struct FsdpGroupContext {
  FsdpStrategy* strategy = nullptr;  // options, communicators, whether gradients sync now
  // Shard group of one rank, no mixed precision, no offload: parameters stay whole (every
  // group is Unsharded from shard() on; unshard and reshard do nothing).
  bool trivial_gather = false;
  // Gradients go through the accumulator hooks and post_backward (anything but one rank
  // in the parameters' own dtype).
  bool grad_path = false;
  // Groups whose reduce-scatter was issued in this backward, in issue order.
  std::vector<FsdpParamGroup*> reduce_order;
  int64_t gather_count = 0;  // all-gathers issued since construction
};

// Where a group's parameters point.
enum class ShardedState {
  Sharded,     // each parameter holds its master shard; the gathered buffer has no storage
  Unsharding,  // unshard() issued the all-gather; parameters still hold their shards
  Unsharded,   // parameters are views of the gathered buffer (compute dtype)
};

// How far a group is through the backward of the current step.
enum class TrainingState {
  Idle,          // no backward owed: before the first forward, after finalize_backward
  PostForward,   // its forward recorded autograd and a backward will follow
  PreBackward,   // backward reached its output (PreBackwardFn): unsharded for its backward
  PostBackward,  // post_backward issued its reduce-scatter (under no_sync nothing is
                 // reduced and the group stays where it was: finalize looks at it again)
};

// The runtime side of one FsdpUnit: its parameters as one flat vector, of which this
// rank holds a stretch, and the unit's lifecycle through a step:
//   forward:  [stash_grads] unshard, wait_for_unshard, compute, reshard (FULL_SHARD)
//   backward: pre_backward (unshard again), gradient hooks -> post_backward
//             (reduce-scatter, reshard), finalize_backward (install shard gradients).
class FsdpParamGroup {
 public:
  FsdpParamGroup(FsdpGroupContext& ctx, int index, FsdpUnitImpl* module, bool root)
      : index(index), module(module), root(root), ctx_(ctx) {}
  FsdpParamGroup(const FsdpParamGroup&) = delete;
  FsdpParamGroup& operator=(const FsdpParamGroup&) = delete;

  const int index;
  FsdpUnitImpl* module = nullptr;
  const bool root;
  std::string prefix;  // FQN prefix of the unit's module ("" for the root)
  std::vector<std::unique_ptr<FsdpParam>> params;
  std::vector<int64_t> rank_numel;  // flat elements per shard-group rank
  int64_t numel = 0;                // elements of the flat vector (all ranks)
  // Gathered and reduced in: mixed precision's dtypes if set, else the unit's own
  // (float64 units stay float64; units mixing dtypes use float32).
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  at::Tensor shard_flat;  // this rank's stretch of the flat vector (undefined if dtypes differ)
  at::Tensor full_flat;   // the whole flat vector in compute dtype; storage freed when resharded
  int grad_params = 0;    // params that require grad
  bool has_frozen = false;

  ShardedState sharded_state() const { return sharded_; }
  TrainingState training_state() const { return training_; }

  // Lays the parameters out as the flat vector, cuts it between the shard-group ranks and
  // points each parameter at this rank's rows (Sharded; Unsharded for good when the
  // gather is trivial). Once, when the unit is registered.
  void shard();
  // Issues the all-gather of the full parameters (Sharded -> Unsharding); else nothing.
  void unshard();
  // Waits for it and points the parameters at the gathered tensors (-> Unsharded).
  void wait_for_unshard();
  // Points the parameters back at their shards and frees the gathered storage (-> Sharded).
  void reshard();

  // Before a forward that records autograd: sets aside the shard gradients present now
  // (accumulated over steps), added back by finalize_backward.
  void stash_grads();
  // After a forward whose output a backward will reach (Idle -> PostForward).
  void expect_backward();
  // Backward reached the unit's output: gather for its backward (-> PreBackward).
  void pre_backward();
  // The group's gradients are in: copy them into the flat order and issue their
  // reduce-scatter (-> PostBackward; under no_sync accumulate them locally instead),
  // then reshard unless the group is the root or has frozen parameters.
  void post_backward();
  // Forwarded but not reduced (parameters without a gradient), and some gradients exist.
  bool owes_post_backward() const;
  // Waits for the issued reduce-scatter, keeping this rank's reduced stretch.
  void wait_for_reduce_scatter();
  // End of backward, for a group in PostBackward: waits for its reduce-scatter, averages
  // the reduced stretch over the replicas (HYBRID_SHARD: a collective, so the Impl calls
  // it in the order the reduce-scatters were issued) and cuts it into shard gradients.
  void finish_reduce();
  // End of backward, for every group: reshard, give each parameter its shard gradient
  // (plus the stashed one) and return to Idle.
  void finalize_backward();

 private:
  void attach_hooks();
  void on_grad_ready(int param);

  FsdpGroupContext& ctx_;
  ShardedState sharded_ = ShardedState::Sharded;
  TrainingState training_ = TrainingState::Idle;
  distributed::Pending gather_work_;
  int ready_count_ = 0;          // params whose gradient hook fired in this backward
  distributed::Pending rs_work_;
  at::Tensor rs_buffer_;  // the flat gradients being reduce-scattered
  at::Tensor rs_piece_;   // this rank's reduced stretch, once rs_work_ is done
};

struct FsdpStrategy::Impl {
  FsdpStrategy* self = nullptr;
  FsdpGroupContext ctx;
  std::vector<std::unique_ptr<FsdpParamGroup>> units;  // root (after setup) is last
  std::vector<int> forward_order;                      // unit indices in forward order
  // The first forward that a backward follows has run: forward_order is complete
  // (prefetch follows it; later forwards no longer extend it).
  bool order_recorded = false;
  // A forward that a backward follows ran and finalize_backward has not run since: set
  // even when the user calls loss.backward() instead of strategy.backward(), so
  // optimizer_step, clipping and state dicts finish that backward first.
  bool finalize_pending = false;
  int64_t prefetch_count = 0;
  // ShardedTensors registered on modules (unregistered when the strategy goes).
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::string>> registered;

  // fsdp_runtime.cpp
  void pre_backward(FsdpParamGroup& g);
  void prefetch_after(int unit, bool forward);
  // Post-backward for groups that still owe it, then every group's finalize_backward.
  void finalize_backward();
  void finalize_if_pending() {
    if (finalize_pending) finalize_backward();
  }
};

}  // namespace tessera::strategy
