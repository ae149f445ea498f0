// FsdpParamGroup (fsdp_impl.h): one unit's flat layout and its lifecycle -- unshard
// (all-gather), reshard (free), post_backward (reduce-scatter of its gradients) and
// finalize_backward (install this rank's shard gradients).
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <algorithm>

#include "tessera/core/log.h"
#include "tessera/sharding/layout.h"
#include "tessera/strategy/fsdp_impl.h"

namespace tessera::strategy {

namespace {

// CPU offload of units that compute on an accelerator.
bool offload_to_host(const FsdpOptions& o) { return o.cpu_offload && !o.device.is_cpu(); }

// Frees a tensor's storage but keeps the StorageImpl (and so every view and saved
// tensor that shares it); alloc_storage gives it memory again. This is how a
// gathered parameter is "freed" while autograd still holds views of it.
void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->nbytes() == 0) return;
  s->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s->set_nbytes(0);
}

void alloc_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nb = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == nb) return;
  // The process's CPU allocator (core/cpu_allocator.h) on the host: the storage may have
  // been made before it was installed.
  s->set_data_ptr_noswap(t.is_cpu() ? c10::GetAllocator(c10::kCPU)->allocate(nb) : s->allocator()->allocate(nb));
  s->set_nbytes(nb);
}

}  // namespace

std::vector<int64_t> FsdpParam::shard_shape(int64_t local) const {
  std::vector<int64_t> s{local};
  for (size_t d = 1; d < shape.size(); ++d) s.push_back(shape[d]);
  return s;
}

// The unit's parameters, flattened and laid end to end in order, form one vector of
// T elements. Shard-group rank r owns the stretch [cut[r], cut[r+1]): the even split
// r*T/S moved to the nearest row boundary of the parameter it falls in. So each
// parameter's local piece is a run of whole rows (a dim-0 shard, possibly empty or the
// whole parameter), a rank's stretch is its pieces back to back, and the gathered
// vector -- the stretches in rank order -- is every parameter whole, one after another:
// gathering writes the parameters in place, and reduce-scattering reads the gradients
// from where they were copied, with no regrouping by rank on either side.
void FsdpParamGroup::shard() {
  FsdpStrategy& st = *ctx_.strategy;
  auto& sc = *st.shard_comm();
  auto& comm = *st.comm();
  const int S = sc.size(), s = sc.rank();
  const auto& o = st.options();
  rank_numel.assign(S, 0);
  grad_params = 0;
  has_frozen = false;
  at::NoGradGuard ng;
  int64_t T = 0;
  bool one_dtype = true;
  for (auto& Pp : params) {
    auto& P = *Pp;
    if (o.sync_module_states && comm.size() > 1) comm.broadcast(P.p, 0);
    P.shape = P.p.sizes().vec();
    P.rows = P.p.dim() == 0 ? 1 : P.p.size(0);
    P.row_numel = 1;
    for (size_t d = 1; d < P.shape.size(); ++d) P.row_numel *= P.shape[d];
    P.flat_offset = T;
    T += P.rows * P.row_numel;
    one_dtype = one_dtype && P.p.scalar_type() == params.front()->p.scalar_type();
    if (P.p.requires_grad())
      ++grad_params;
    else
      has_frozen = true;
  }
  std::vector<int64_t> cut(S + 1, 0);
  cut[S] = T;
  for (int k = 1; k < S; ++k) {
    int64_t c = T / S * k + T % S * k / S;  // floor(T*k/S) without overflow
    for (auto& Pp : params) {
      auto& P = *Pp;
      const int64_t n = P.rows * P.row_numel;
      if (n == 0 || c < P.flat_offset || c >= P.flat_offset + n) continue;
      c = P.flat_offset + (c - P.flat_offset + P.row_numel / 2) / P.row_numel * P.row_numel;
      break;
    }
    cut[k] = std::max(cut[k - 1], c);
  }
  for (int r = 0; r < S; ++r) rank_numel[r] = cut[r + 1] - cut[r];
  numel = T;
  const auto& mp = o.mixed_precision;
  const at::ScalarType own = one_dtype && !params.empty() && at::isFloatingType(params.front()->p.scalar_type())
                                 ? params.front()->p.scalar_type()
                                 : at::kFloat;
  compute_dtype = mp.param_dtype.value_or(own);
  reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype ? at::kFloat : own);
  int64_t shard_off = 0;
  for (auto& Pp : params) {
    auto& P = *Pp;
    const int64_t n = P.rows * P.row_numel;
    // The unit's cut as it falls on this parameter's rows (sharding/layout.h: the rule a
    // sharded checkpoint records for it, so both agree by construction).
    // Each rank checks its own rows against the unit's cut (so all are checked, in O(1) each).
    const sharding::Range mine = sharding::flat_rows(T, P.flat_offset, {P.rows, P.row_numel}, S, s);
    P.local_rows = mine.size;
    P.row_begin = mine.begin;
    if (P.row_numel > 0) {
      const int64_t lo = std::clamp(cut[s], P.flat_offset, P.flat_offset + n);
      const int64_t hi = std::clamp(cut[s + 1], P.flat_offset, P.flat_offset + n);
      TESSERA_CHECK(P.local_rows == (hi - lo) / P.row_numel && (P.local_rows == 0 || P.row_begin * P.row_numel == lo - P.flat_offset),
                    "internal: FSDP's cut of '", P.fqn, "' on rank ", s, " differs from sharding::flat_rows");
    }
    P.shard_offset = shard_off;
    shard_off += P.local_rows * P.row_numel;
  }
  if (ctx_.trivial_gather) {
    for (auto& P : params) P->shard = P->p.detach();
    sharded_ = ShardedState::Unsharded;
    attach_hooks();
    return;
  }
  const c10::Device shard_dev = o.cpu_offload ? c10::Device(c10::kCPU) : o.device;
  // Master shards are views of one buffer when the unit has one dtype, so the
  // gather sends that buffer as it is.
  if (params.empty())
    shard_flat = at::empty({0}, at::TensorOptions().dtype(compute_dtype).device(shard_dev));
  else if (one_dtype)
    // Offloaded shards of a GPU unit live in pinned host memory, so that the gather's
    // host-to-device copy is asynchronous (unshard).
    shard_flat = at::empty({rank_numel[s]},
                           params.front()->p.options().device(shard_dev).pinned_memory(offload_to_host(o)));
  full_flat = at::empty({T}, at::TensorOptions().dtype(compute_dtype).device(o.device));
  for (auto& Pp : params) {
    auto& P = *Pp;
    const int64_t local_rows = P.local_rows;
    at::Tensor src = P.p.detach().reshape({P.rows, P.row_numel}).narrow(0, P.row_begin, local_rows);
    at::Tensor local;
    if (shard_flat.defined()) {
      local = shard_flat.narrow(0, P.shard_offset, local_rows * P.row_numel).view(P.shard_shape(local_rows));
      local.view({local_rows, P.row_numel}).copy_(src);
    } else {
      local = src.to(shard_dev, /*non_blocking=*/false, /*copy=*/true).view(P.shard_shape(local_rows));
    }
    P.full = full_flat.narrow(0, P.flat_offset, P.rows * P.row_numel).view(P.shape);
    P.p.set_data(local);
    P.shard = local;
  }
  free_storage(full_flat);
}

void FsdpParamGroup::attach_hooks() {
  if (!ctx_.grad_path) return;
  for (size_t k = 0; k < params.size(); ++k) {
    const int pk = static_cast<int>(k);
    params[k]->hook.attach(params[k]->p, [this, pk] { on_grad_ready(pk); });
  }
}

void FsdpParamGroup::unshard() {
  if (sharded_ != ShardedState::Sharded || ctx_.trivial_gather) return;
  const FsdpStrategy& st = *ctx_.strategy;
  const auto& o = st.options();
  at::NoGradGuard ng;
  at::Tensor local;
  if (shard_flat.defined()) {
    // Itself when nothing changes. From pinned host memory (CPU offload of a GPU unit) the
    // copy is queued on the current stream and the host goes on; the shard is written
    // next by the optimizer step, after finalize_backward's blocking device-to-host
    // gradient copies have drained that stream.
    local = shard_flat.to(o.device, compute_dtype, /*non_blocking=*/offload_to_host(o));
  } else {
    std::vector<at::Tensor> pieces;
    for (auto& P : params) pieces.push_back(P->shard.reshape({-1}).to(o.device, compute_dtype));
    local = at::cat(pieces);
  }
  alloc_storage(full_flat);
  ++ctx_.gather_count;
  gather_work_ = st.shard_comm()->all_gather_async(local, rank_numel, full_flat);
  sharded_ = ShardedState::Unsharding;
}

void FsdpParamGroup::wait_for_unshard() {
  if (sharded_ != ShardedState::Unsharding) return;
  gather_work_.wait();
  gather_work_ = distributed::Pending();
  for (auto& P : params) P->p.set_data(P->full);
  sharded_ = ShardedState::Unsharded;
  attach_hooks();
}

void FsdpParamGroup::reshard() {
  if (ctx_.trivial_gather) return;
  wait_for_unshard();
  if (sharded_ != ShardedState::Unsharded) return;
  for (auto& P : params) P->p.set_data(P->shard);
  free_storage(full_flat);
  sharded_ = ShardedState::Sharded;
}

void FsdpParamGroup::stash_grads() {
  if (!ctx_.grad_path) return;
  for (auto& P : params) {
    at::Tensor g = P->p.grad();
    if (!g.defined()) continue;
    TESSERA_CHECK(g.sizes() == P->shard.sizes(), "FSDP: parameter '", P->fqn, "' has a gradient of shape ", g.sizes(),
                  " where its shard has shape ", P->shard.sizes(),
                  " (a previous backward was not finished by strategy.backward())");
    P->stash_grad = P->stash_grad.defined() ? P->stash_grad + g : g;
    P->p.mutable_grad() = at::Tensor();
  }
}

void FsdpParamGroup::expect_backward() {
  if (training_ == TrainingState::Idle) training_ = TrainingState::PostForward;
}

void FsdpParamGroup::pre_backward() {
  if (training_ == TrainingState::PostForward) training_ = TrainingState::PreBackward;
  unshard();
  wait_for_unshard();
}

void FsdpParamGroup::on_grad_ready(int pk) {
  auto& P = *params[pk];
  if (P.ready) return;
  P.ready = true;
  if (++ready_count_ == grad_params && training_ != TrainingState::PostBackward) post_backward();
}

bool FsdpParamGroup::owes_post_backward() const {
  if (training_ != TrainingState::PostForward && training_ != TrainingState::PreBackward) return false;
  bool has_grad = ready_count_ > 0;
  for (auto& P : params) has_grad = has_grad || P->p.grad().defined();
  return has_grad;
}

void FsdpParamGroup::post_backward() {
  at::NoGradGuard ng;
  const FsdpStrategy& st = *ctx_.strategy;
  const bool sync = st.grad_sync_enabled();
  bool any = false;
  at::Tensor flat;  // the unit's full gradients in the flat layout, in reduce dtype
  if (sync) flat = at::empty({numel}, at::TensorOptions().dtype(reduce_dtype).device(st.options().device));
  for (auto& Pp : params) {
    auto& P = *Pp;
    at::Tensor g = P.p.grad();
    P.p.mutable_grad() = at::Tensor();
    if (g.defined()) any = true;
    if (!sync) {
      // Accumulated in at least float32 (bf16/fp16 compute gradients would lose bits).
      if (g.defined()) {
        at::Tensor acc = g.to(at::promote_types(g.scalar_type(), at::kFloat));
        P.unsynced = P.unsynced.defined() ? P.unsynced + acc : acc;
      }
      continue;
    }
    at::Tensor dst = flat.narrow(0, P.flat_offset, P.rows * P.row_numel).view(P.shape);
    if (P.unsynced.defined()) {
      dst.copy_(g.defined() ? P.unsynced + g : P.unsynced);
      P.unsynced = at::Tensor();
    } else if (g.defined()) {
      dst.copy_(g);
    } else {
      dst.zero_();
    }
  }
  if (sync && (any || ready_count_ > 0)) {
    // The reduce-scatters issued before this one had at least one unit's backward to
    // complete: finishing them here frees their flat gradients, so no more than two
    // units' full gradients exist at a time (not the whole model's until the end).
    for (FsdpParamGroup* g : ctx_.reduce_order) g->wait_for_reduce_scatter();
    rs_buffer_ = flat;
    rs_work_ = st.shard_comm()->reduce_scatter_async(rs_buffer_, rank_numel, distributed::ReduceOp::Avg);
    training_ = TrainingState::PostBackward;
    ctx_.reduce_order.push_back(this);
  }
  if (!root && !has_frozen) reshard();
}

void FsdpParamGroup::wait_for_reduce_scatter() {
  if (!rs_work_.valid()) return;
  rs_piece_ = rs_work_.wait();
  rs_work_ = distributed::Pending();
  rs_buffer_ = at::Tensor();
}

void FsdpParamGroup::finish_reduce() {
  if (training_ != TrainingState::PostBackward) return;
  const FsdpStrategy& st = *ctx_.strategy;
  at::NoGradGuard ng;
  wait_for_reduce_scatter();
  at::Tensor piece = std::move(rs_piece_);  // leaves rs_piece_ undefined
  if (st.replicate_comm()->size() > 1) st.replicate_comm()->all_reduce(piece, distributed::ReduceOp::Avg);
  for (auto& P : params) {
    const int64_t n = P->local_rows * P->row_numel;
    P->new_grad =
        piece.narrow(0, P->shard_offset, n).to(P->shard.device(), P->shard.scalar_type()).view(P->shard_shape(P->local_rows));
  }
}

void FsdpParamGroup::finalize_backward() {
  reshard();
  for (auto& P : params) {
    if (ctx_.grad_path) {
      at::Tensor g = P->stash_grad;
      // new_grad is a view of the unit's reduced piece. The gradient shares its memory
      // (the parameters' pieces are disjoint) but is not a view to autograd:
      // optimizers' zero_grad detaches gradients in place, which views do not allow.
      if (P->new_grad.defined()) g = g.defined() ? g + P->new_grad : detail::alias_of(P->new_grad);
      if (g.defined()) P->p.mutable_grad() = g;
    }
    P->stash_grad = at::Tensor();
    P->new_grad = at::Tensor();
    P->ready = false;
  }
  ready_count_ = 0;
  training_ = TrainingState::Idle;
}

}  // namespace tessera::strategy
