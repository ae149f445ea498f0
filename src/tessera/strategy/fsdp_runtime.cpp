// FSDP at run time, the strategy's side: a unit's forward (gather, compute, free, the
// hooks that bring its backward), the forward order and prefetch, and the end of
// backward over all units. What each unit does lives in FsdpParamGroup
// (fsdp_param_group.cpp).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "tessera/core/log.h"
#include "tessera/strategy/fsdp_impl.h"

namespace tessera::strategy {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

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
  if (v.sharded_state() != ShardedState::Sharded) return;
  v.unshard();
  ++prefetch_count;
}

void FsdpStrategy::Impl::pre_backward(FsdpParamGroup& g) {
  g.pre_backward();
  prefetch_after(g.index, /*forward=*/false);
}

void FsdpStrategy::Impl::finalize_backward() {
  finalize_pending = false;
  if (ctx.grad_path) {
    // Units whose gradients were only partly produced (unused parameters), and in
    // no-sync mode whatever gradients are still full-size.
    for (auto& g : units)
      if (g->owes_post_backward()) g->post_backward();
    for (FsdpParamGroup* g : ctx.reduce_order) g->finish_reduce();
  }
  for (auto& g : units) g->finalize_backward();
  ctx.reduce_order.clear();
}

at::Tensor FsdpStrategy::unit_forward(FsdpUnitImpl& m, const at::Tensor& x_in) {
  auto& I = *impl_;
  TESSERA_CHECK(m.unit_index >= 0 && m.unit_index < static_cast<int>(I.units.size()),
                "FSDP: unit ", m.name(), " is not registered with this strategy");
  auto& g = *I.units[m.unit_index];
  const bool grad = at::GradMode::is_enabled();
  if (grad) g.stash_grads();
  g.unshard();
  g.wait_for_unshard();
  if (!I.order_recorded && std::find(I.forward_order.begin(), I.forward_order.end(), g.index) == I.forward_order.end())
    I.forward_order.push_back(g.index);
  I.prefetch_after(g.index, /*forward=*/true);
  at::Tensor x = x_in;
  if (options_.mixed_precision.param_dtype && x.is_floating_point()) x = x.to(*options_.mixed_precision.param_dtype);
  at::Tensor y;
  const int64_t ip = reinterpret_cast<int64_t>(&I);
  if (grad && options_.activation_checkpointing && !g.root) {
    std::vector<at::Tensor> ps;
    for (auto& P : g.params)
      if (P->p.requires_grad()) ps.push_back(P->p);
    y = CheckpointFn::apply(ip, static_cast<int64_t>(g.index), x, at::TensorList(ps));
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
                                    I.forward_order.back() == g.index;
  if (!g.root && free_after && !backward_starts_here) g.reshard();
  if (will_backward && I.ctx.grad_path) {
    if (!I.ctx.trivial_gather) y = PreBackwardFn::apply(ip, static_cast<int64_t>(g.index), y);
    g.expect_backward();
    I.finalize_pending = true;
  }
  if (g.root) {
    if (!will_backward) {
      for (auto& u : I.units) u->reshard();
    } else {
      I.order_recorded = true;
    }
    if (options_.mixed_precision.param_dtype && y.is_floating_point()) y = y.to(options_.mixed_precision.output_dtype);
  }
  return y;
}

void FsdpStrategy::backward(const at::Tensor& loss) {
  detail::BackwardGuard("FSDP", module_).run(loss);
  impl_->finalize_backward();
}

}  // namespace tessera::strategy
