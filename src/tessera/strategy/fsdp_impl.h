// FSDP internals shared by fsdp.cpp (setup, state dicts, clipping) and
// fsdp_runtime.cpp (gather, free, hooks, reduce-scatter). Not a public header.
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
  std::vector<int64_t> rank_rows; // rows of each shard-group rank (the unit's row-aligned cut)
  int64_t row_begin = 0;          // first row of this rank
  int64_t flat_offset = 0;        // where the parameter starts in the unit's flat vector
  int64_t shard_offset = 0;       // where its local rows start in this rank's stretch
  at::Tensor shard;               // master shard [local rows, shape[1:]...] (a view of the unit's shard_flat)
  at::Tensor full;                // gathered parameter (compute dtype): a view of the unit's full_flat
  at::Tensor stash_grad;          // shard grad held across a forward/backward
  at::Tensor unsynced;            // full-size grad accumulated under no_sync
  at::Tensor new_grad;            // reduced shard grad of this backward
  bool ready = false;
  detail::AccumulatorHook hook;

  int64_t local_rows(int r) const { return rank_rows[r]; }
  std::vector<int64_t> shard_shape(int64_t local_rows) const;
};

struct FsdpUnitState {
  int index = -1;
  FsdpUnitImpl* module = nullptr;
  std::string prefix;  // FQN prefix of the unit's module ("" for the root)
  bool root = false;
  std::vector<std::unique_ptr<FsdpParam>> params;
  std::vector<int64_t> rank_numel;  // flat elements per shard-group rank
  int64_t numel = 0;                // elements of the flat vector (all ranks)
  // Gathered and reduced in: mixed precision's dtypes if set, else the unit's own
  // (float64 units stay float64; units mixing dtypes use float32).
  at::ScalarType compute_dtype = at::kFloat;
  at::ScalarType reduce_dtype = at::kFloat;
  at::Tensor shard_flat;  // this rank's stretch of the flat vector (undefined if dtypes differ)
  at::Tensor full_flat;   // the whole flat vector in compute dtype; storage freed when resharded
  int grad_params = 0;              // params that require grad
  bool has_frozen = false;
  // runtime
  bool gathered = false;
  distributed::Pending gather_work;
  bool gather_pending = false;
  int ready_count = 0;
  bool reduced = false;
  bool forwarded = false;
  distributed::Pending rs_work;
  at::Tensor rs_buffer;  // the flat gradients being reduce-scattered
  at::Tensor rs_piece;   // this rank's reduced stretch, once rs_work is done
};

struct FsdpStrategy::Impl {
  FsdpStrategy* self = nullptr;
  std::vector<std::unique_ptr<FsdpUnitState>> units;  // root (after setup) is last
  std::vector<int> forward_order;                     // unit indices in forward order
  bool order_recorded = false;
  std::vector<int> reduce_order;  // units whose reduce-scatter was launched this backward
  bool in_backward = false;
  bool needs_finalize = false;
  bool trivial_gather = false;  // shard group of 1 and no mixed precision: params stay full
  bool grad_path = false;       // gradients go through hooks (anything but 1 rank in fp32)
  int64_t prefetch_count = 0;
  int64_t gather_count = 0;
  // ShardedTensors registered on modules (unregistered when the strategy goes).
  std::vector<std::pair<std::weak_ptr<torch::nn::Module>, std::string>> registered;

  // fsdp_runtime.cpp
  void shard_unit(FsdpUnitState& u);
  void start_gather(FsdpUnitState& u);
  void finish_gather(FsdpUnitState& u);
  void gather(FsdpUnitState& u);
  void reshard(FsdpUnitState& u);
  void stash_grads(FsdpUnitState& u);
  void attach_hooks(FsdpUnitState& u);
  void on_grad_ready(int unit, int param);
  void post_backward(FsdpUnitState& u);
  void finish_reduce(FsdpUnitState& u);
  void pre_backward(FsdpUnitState& u);
  void finalize();
  void prefetch_after(int unit, bool forward);
};

}  // namespace tessera::strategy
