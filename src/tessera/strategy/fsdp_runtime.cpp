// FSDP at run time: all-gather before a unit computes, free after, re-gather before
// its backward, reduce-scatter its gradients once they are all accumulated, and the
// end-of-backward bookkeeping (wait, install shard gradients, reshard).
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "tessera/core/log.h"
#include "tessera/strategy/fsdp_impl.h"

namespace tessera::strategy {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Frees a tensor's storage but keeps the StorageImpl (and so every view and saved
// tensor that shares it); alloc_storage gives it memory again. This is how a
// gathered parameter is "freed" while autograd still holds views of it.
// CPU offload of units that compute on an accelerator.
bool offload_to_host(const FsdpOptions& o) { return o.cpu_offload && !o.device.is_cpu(); }

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

FsdpStrategy::Impl* impl_of(AutogradContext* ctx) {
  return reinterpret_cast<FsdpStrategy::Impl*>(ctx->saved_data["impl"].toInt());
}

// Identity on a unit's output; its backward runs before any of the unit's own
// backward nodes (they all need this output's gradient) and re-gathers the unit.
struct PreBackwardFn : public torch::autograd::Function<PreBackwardFn> {
  static at::Tensor forward(AutogradContext* ctx, int64_t impl, int64_t unit, const at::Tensor& y) {
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["unit"] = unit;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* I = impl_of(ctx);
    I->pre_backward(*I->units.at(ctx->saved_data["unit"].toInt()));
    return {at::Tensor(), at::Tensor(), grads[0]};
  }
};

// Activation checkpointing: the unit's forward runs without saving activations; its
// backward (after PreBackwardFn re-gathered the parameters) recomputes the forward
// with grad enabled and back-propagates through it (re-entrant backward, which
// accumulates the parameters' gradients and so fires the FSDP gradient hooks).
struct CheckpointFn : public torch::autograd::Function<CheckpointFn> {
  static at::Tensor forward(AutogradContext* ctx, int64_t impl, int64_t unit, const at::Tensor& x,
                            at::TensorList params) {
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["unit"] = unit;
    ctx->saved_data["x_requires_grad"] = x.requires_grad();
    ctx->saved_data["n"] = static_cast<int64_t>(params.size());
    ctx->save_for_backward({x});
    auto* I = reinterpret_cast<FsdpStrategy::Impl*>(impl);
    return I->units.at(unit)->module->run_wrapped(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* I = impl_of(ctx);
    auto& u = *I->units.at(ctx->saved_data["unit"].toInt());
    at::Tensor x = ctx->get_saved_variables()[0].detach();
    const bool xrg = ctx->saved_data["x_requires_grad"].toBool();
    if (xrg) x.requires_grad_(true);
    at::Tensor y;
    {
      at::AutoGradMode on(true);
      y = u.module->run_wrapped(x);
    }
    if (y.requires_grad()) torch::autograd::backward({y}, {grads[0]});
    variable_list out(3 + ctx->saved_data["n"].toInt());
    if (xrg) out[2] = x.grad();
    return out;
  }
};

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
void FsdpStrategy::Impl::shard_unit(FsdpUnitState& u) {
  auto& sc = *self->shard_comm_;
  const int S = sc.size(), s = sc.rank();
  const auto& o = self->options_;
  u.rank_numel.assign(S, 0);
  u.grad_params = 0;
  u.has_frozen = false;
  at::NoGradGuard ng;
  int64_t T = 0;
  bool one_dtype = true;
  for (auto& Pp : u.params) {
    auto& P = *Pp;
    if (o.sync_module_states && self->comm_->size() > 1) self->comm_->broadcast(P.p, 0);
    P.shape = P.p.sizes().vec();
    P.rows = P.p.dim() == 0 ? 1 : P.p.size(0);
    P.row_numel = 1;
    for (size_t d = 1; d < P.shape.size(); ++d) P.row_numel *= P.shape[d];
    P.flat_offset = T;
    T += P.rows * P.row_numel;
    one_dtype = one_dtype && P.p.scalar_type() == u.params.front()->p.scalar_type();
    if (P.p.requires_grad())
      ++u.grad_params;
    else
      u.has_frozen = true;
  }
  std::vector<int64_t> cut(S + 1, 0);
  cut[S] = T;
  for (int k = 1; k < S; ++k) {
    int64_t c = T / S * k + T % S * k / S;  // floor(T*k/S) without overflow
    for (auto& Pp : u.params) {
      auto& P = *Pp;
      const int64_t n = P.rows * P.row_numel;
      if (n == 0 || c < P.flat_offset || c >= P.flat_offset + n) continue;
      c = P.flat_offset + (c - P.flat_offset + P.row_numel / 2) / P.row_numel * P.row_numel;
      break;
    }
    cut[k] = std::max(cut[k - 1], c);
  }
  for (int r = 0; r < S; ++r) u.rank_numel[r] = cut[r + 1] - cut[r];
  u.numel = T;
  const auto& mp = o.mixed_precision;
  const at::ScalarType own = one_dtype && !u.params.empty() && at::isFloatingType(u.params.front()->p.scalar_type())
                                 ? u.params.front()->p.scalar_type()
                                 : at::kFloat;
  u.compute_dtype = mp.param_dtype.value_or(own);
  u.reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype ? at::kFloat : own);
  int64_t shard_off = 0;
  for (auto& Pp : u.params) {
    auto& P = *Pp;
    const int64_t n = P.rows * P.row_numel;
    P.rank_rows.assign(S, 0);
    if (P.row_numel == 0) {
      P.rank_rows[0] = P.rows;  // no elements: every (empty) row on the first rank
    } else {
      for (int r = 0; r < S; ++r) {
        const int64_t lo = std::clamp(cut[r], P.flat_offset, P.flat_offset + n);
        const int64_t hi = std::clamp(cut[r + 1], P.flat_offset, P.flat_offset + n);
        P.rank_rows[r] = (hi - lo) / P.row_numel;
      }
    }
    P.row_begin = 0;
    for (int r = 0; r < s; ++r) P.row_begin += P.rank_rows[r];
    P.shard_offset = shard_off;
    shard_off += P.rank_rows[s] * P.row_numel;
  }
  if (trivial_gather) {
    for (auto& P : u.params) P->shard = P->p.detach();
    u.gathered = true;
    attach_hooks(u);
    return;
  }
  const c10::Device shard_dev = o.cpu_offload ? c10::Device(c10::kCPU) : o.device;
  // Master shards are views of one buffer when the unit has one dtype, so the
  // gather sends that buffer as it is.
  if (u.params.empty())
    u.shard_flat = at::empty({0}, at::TensorOptions().dtype(u.compute_dtype).device(shard_dev));
  else if (one_dtype)
    // Offloaded shards of a GPU unit live in pinned host memory, so that the gather's
    // host-to-device copy is asynchronous (start_gather).
    u.shard_flat = at::empty({u.rank_numel[s]},
                             u.params.front()->p.options().device(shard_dev).pinned_memory(offload_to_host(o)));
  u.full_flat = at::empty({T}, at::TensorOptions().dtype(u.compute_dtype).device(o.device));
  for (auto& Pp : u.params) {
    auto& P = *Pp;
    const int64_t local_rows = P.rank_rows[s];
    at::Tensor src = P.p.detach().reshape({P.rows, P.row_numel}).narrow(0, P.row_begin, local_rows);
    at::Tensor local;
    if (u.shard_flat.defined()) {
      local = u.shard_flat.narrow(0, P.shard_offset, local_rows * P.row_numel).view(P.shard_shape(local_rows));
      local.view({local_rows, P.row_numel}).copy_(src);
    } else {
      local = src.to(shard_dev, /*non_blocking=*/false, /*copy=*/true).view(P.shard_shape(local_rows));
    }
    P.full = u.full_flat.narrow(0, P.flat_offset, P.rows * P.row_numel).view(P.shape);
    P.p.set_data(local);
    P.shard = local;
  }
  free_storage(u.full_flat);
}

void FsdpStrategy::Impl::attach_hooks(FsdpUnitState& u) {
  if (!grad_path) return;
  for (size_t k = 0; k < u.params.size(); ++k) {
    const int ui = u.index, pk = static_cast<int>(k);
    u.params[k]->hook.attach(u.params[k]->p, [this, ui, pk] { on_grad_ready(ui, pk); });
  }
}

void FsdpStrategy::Impl::start_gather(FsdpUnitState& u) {
  if (u.gathered || u.gather_pending || trivial_gather) return;
  at::NoGradGuard ng;
  at::Tensor local;
  if (u.shard_flat.defined()) {
    // Itself when nothing changes. From pinned host memory (CPU offload of a GPU unit) the
    // copy is queued on the current stream and the host goes on; the shard is written
    // next by the optimizer step, after finalize's blocking device-to-host gradient
    // copies have drained that stream.
    local = u.shard_flat.to(self->options_.device, u.compute_dtype, /*non_blocking=*/offload_to_host(self->options_));
  } else {
    std::vector<at::Tensor> pieces;
    for (auto& P : u.params) pieces.push_back(P->shard.reshape({-1}).to(self->options_.device, u.compute_dtype));
    local = at::cat(pieces);
  }
  alloc_storage(u.full_flat);
  ++gather_count;
  u.gather_work = self->shard_comm_->all_gather_async(local, u.rank_numel, u.full_flat);
  u.gather_pending = true;
}

void FsdpStrategy::Impl::finish_gather(FsdpUnitState& u) {
  if (!u.gather_pending) return;
  u.gather_work.wait();
  u.gather_pending = false;
  u.gather_work = distributed::Pending();
  for (auto& P : u.params) P->p.set_data(P->full);
  u.gathered = true;
  attach_hooks(u);
}

void FsdpStrategy::Impl::gather(FsdpUnitState& u) {
  if (u.gathered || trivial_gather) return;
  start_gather(u);
  finish_gather(u);
}

void FsdpStrategy::Impl::reshard(FsdpUnitState& u) {
  if (trivial_gather) return;
  if (u.gather_pending) finish_gather(u);
  if (!u.gathered) return;
  for (auto& P : u.params) P->p.set_data(P->shard);
  free_storage(u.full_flat);
  u.gathered = false;
}

void FsdpStrategy::Impl::stash_grads(FsdpUnitState& u) {
  if (!grad_path) return;
  for (auto& P : u.params) {
    at::Tensor g = P->p.grad();
    if (!g.defined()) continue;
    TESSERA_CHECK(g.sizes() == P->shard.sizes(), "FSDP: parameter '", P->fqn, "' has a gradient of shape ", g.sizes(),
                  " where its shard has shape ", P->shard.sizes(),
                  " (a previous backward was not finished by strategy.backward())");
    P->stash_grad = P->stash_grad.defined() ? P->stash_grad + g : g;
    P->p.mutable_grad() = at::Tensor();
  }
}

void FsdpStrategy::Impl::prefetch_after(int ui, bool forward) {
  if (!self->options_.prefetch || !order_recorded) return;
  auto it = std::find(forward_order.begin(), forward_order.end(), ui);
  if (it == forward_order.end()) return;
  const auto pos = it - forward_order.begin();
  // Backward runs units in reverse forward order; the root (first forward, first
  // backward) hands over to the last unit.
  auto next = forward ? pos + 1 : pos - 1;
  if (!forward && units[ui]->root) next = static_cast<decltype(next)>(forward_order.size()) - 1;
  if (next < 0 || next >= static_cast<decltype(next)>(forward_order.size())) return;
  auto& v = *units[forward_order[next]];
  if (v.gathered || v.gather_pending) return;
  start_gather(v);
  ++prefetch_count;
}

void FsdpStrategy::Impl::pre_backward(FsdpUnitState& u) {
  gather(u);
  prefetch_after(u.index, /*forward=*/false);
}

void FsdpStrategy::Impl::on_grad_ready(int ui, int pk) {
  auto& u = *units[ui];
  auto& P = *u.params[pk];
  if (P.ready) return;
  P.ready = true;
  if (++u.ready_count == u.grad_params && !u.reduced) post_backward(u);
}

void FsdpStrategy::Impl::post_backward(FsdpUnitState& u) {
  at::NoGradGuard ng;
  const bool sync = self->sync_grads_;
  bool any = false;
  at::Tensor flat;  // the unit's full gradients in the flat layout, in reduce dtype
  if (sync)
    flat = at::empty(
        {u.numel}, at::TensorOptions().dtype(u.reduce_dtype).device(self->options_.device));
  for (auto& Pp : u.params) {
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
  if (sync && (any || u.ready_count > 0)) {
    // The reduce-scatters issued before this one had at least one unit's backward to
    // complete: finishing them here frees their flat gradients, so no more than two
    // units' full gradients exist at a time (not the whole model's until the end).
    for (int ui : reduce_order) finish_reduce(*units[ui]);
    u.rs_buffer = flat;
    u.rs_work = self->shard_comm_->reduce_scatter_async(u.rs_buffer, u.rank_numel, distributed::ReduceOp::Avg);
    u.reduced = true;
    reduce_order.push_back(u.index);
  }
  if (!u.root && !u.has_frozen) reshard(u);
}

void FsdpStrategy::Impl::finish_reduce(FsdpUnitState& u) {
  if (!u.rs_work.valid()) return;
  u.rs_piece = u.rs_work.wait();
  u.rs_work = distributed::Pending();
  u.rs_buffer = at::Tensor();
}

void FsdpStrategy::Impl::finalize() {
  in_backward = false;
  needs_finalize = false;
  const bool sync = self->sync_grads_;
  if (grad_path) {
    // Units whose gradients were only partly produced (unused parameters), and in
    // no-sync mode whatever gradients are still full-size.
    for (auto& up : units) {
      auto& u = *up;
      if (!u.forwarded || u.reduced) continue;
      bool has_grad = u.ready_count > 0;
      for (auto& P : u.params) has_grad = has_grad || P->p.grad().defined();
      if (has_grad) post_backward(u);
    }
    at::NoGradGuard ng;
    for (int ui : reduce_order) {
      auto& u = *units[ui];
      finish_reduce(u);
      at::Tensor piece = std::move(u.rs_piece);  // leaves rs_piece undefined
      if (self->replicate_comm_->size() > 1) self->replicate_comm_->all_reduce(piece, distributed::ReduceOp::Avg);
      const int s = self->shard_comm_->rank();
      for (auto& P : u.params) {
        const int64_t n = P->rank_rows[s] * P->row_numel;
        P->new_grad =
            piece.narrow(0, P->shard_offset, n).to(P->shard.device(), P->shard.scalar_type()).view(P->shard_shape(P->rank_rows[s]));
      }
    }
  }
  for (auto& up : units) reshard(*up);
  for (auto& up : units) {
    auto& u = *up;
    for (auto& P : u.params) {
      if (grad_path) {
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
    u.ready_count = 0;
    u.reduced = false;
    u.forwarded = false;
  }
  reduce_order.clear();
  (void)sync;
}

at::Tensor FsdpStrategy::unit_forward(FsdpUnitImpl& m, const at::Tensor& x_in) {
  auto& I = *impl_;
  TESSERA_CHECK(m.unit_index >= 0 && m.unit_index < static_cast<int>(I.units.size()),
                "FSDP: unit ", m.name(), " is not registered with this strategy");
  auto& u = *I.units[m.unit_index];
  const bool grad = at::GradMode::is_enabled();
  if (grad) I.stash_grads(u);
  I.gather(u);
  if (!I.order_recorded && std::find(I.forward_order.begin(), I.forward_order.end(), u.index) == I.forward_order.end())
    I.forward_order.push_back(u.index);
  I.prefetch_after(u.index, /*forward=*/true);
  at::Tensor x = x_in;
  if (options_.mixed_precision.param_dtype && x.is_floating_point()) x = x.to(*options_.mixed_precision.param_dtype);
  at::Tensor y;
  const int64_t ip = reinterpret_cast<int64_t>(&I);
  if (grad && options_.activation_checkpointing && !u.root) {
    std::vector<at::Tensor> ps;
    for (auto& P : u.params)
      if (P->p.requires_grad()) ps.push_back(P->p);
    y = CheckpointFn::apply(ip, static_cast<int64_t>(u.index), x, at::TensorList(ps));
  } else {
    y = m.run_wrapped(x);
  }
  const bool will_backward = grad && y.requires_grad();
  // FULL_SHARD frees a unit after its forward, except the last unit of the recorded
  // forward order when a backward follows: backward starts with it, so freeing it
  // would only gather it again at once.
  const bool free_after = options_.sharding == ShardingStrategy::FullShard ||
                          options_.sharding == ShardingStrategy::HybridShard;
  const bool backward_starts_here = will_backward && I.order_recorded && !I.forward_order.empty() &&
                                    I.forward_order.back() == u.index;
  if (!u.root && free_after && !backward_starts_here) I.reshard(u);
  if (will_backward && I.grad_path) {
    if (!I.trivial_gather) y = PreBackwardFn::apply(ip, static_cast<int64_t>(u.index), y);
    u.forwarded = true;
    I.needs_finalize = true;
  }
  if (u.root) {
    if (!will_backward) {
      for (auto& up : I.units) I.reshard(*up);
    } else {
      I.order_recorded = true;
    }
    if (options_.mixed_precision.param_dtype && y.is_floating_point()) y = y.to(options_.mixed_precision.output_dtype);
  }
  return y;
}

void FsdpStrategy::backward(const at::Tensor& loss) {
  TESSERA_CHECK(module_, "FSDP: backward before setup()");
  auto& I = *impl_;
  I.in_backward = true;
  try {
    torch::autograd::backward({loss});
  } catch (...) {
    I.in_backward = false;
    throw;
  }
  I.finalize();
}

}  // namespace tessera::strategy
