// Rank programs for the strategy tests: DDP and FSDP (every sharding strategy, bf16 and
// float64, explicit units) trained on the shared attention model with uneven parameter
// sizes, compared step by step with single-process training on the same global batch
// (computed in-process by every rank: the model is tiny).
#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>

#include "strategy/strategy_scenario_util.h"
#include "support/scenario.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::testing::strategy_util;
using namespace tessera::strategy;

namespace {

// The same model with explicit units built through the strategy's module-init
// context (each block is sharded as soon as it exists); same FQNs as make_model.
struct NetImpl : torch::nn::Module {
  torch::nn::Linear in{nullptr}, head{nullptr};
  torch::nn::AnyModule b0, b1;
  explicit NetImpl(Strategy& s) {
    at::manual_seed(7);
    in = register_module("0", torch::nn::Linear(5, 7));
    b0 = s.init_module([] { return torch::nn::AnyModule(Block()); });
    register_module("1", b0.ptr());
    b1 = s.init_module([] { return torch::nn::AnyModule(Block()); });
    register_module("2", b1.ptr());
    head = register_module("3", torch::nn::Linear(7, 3));
  }
  at::Tensor forward(const at::Tensor& x) { return head(b1.forward(b0.forward(in(x)))); }
};
TORCH_MODULE(Net);

// Trains `kind` for `steps` on this rank's rows of each global batch.
Trace train(const std::string& kind, int steps, double clip, double lr, int micro = 1,
            Strategy** out_strategy = nullptr, std::unique_ptr<Strategy>* keep = nullptr) {
  auto c = comm();
  auto strat = make_strategy(kind, c);
  auto model = make_model();
  auto m = strat->setup(model);
  auto opt = std::make_shared<torch::optim::Adam>(strat->module()->parameters(), torch::optim::AdamOptions(lr));
  strat->add_optimizer(opt);
  auto* fsdp = dynamic_cast<FsdpStrategy*>(strat.get());
  auto* ddp = dynamic_cast<DdpStrategy*>(strat.get());
  const int n = c->size();
  if (fsdp) {
    // Two Block units (auto-wrapped children of the Sequential) plus the root.
    WCHECK(fsdp->num_units() == 3, kind, ": ", fsdp->num_units(), " units");
    WCHECK(fsdp->unit_params()[2].size() == 4, kind, ": root holds ", fsdp->unit_params()[2].size(), " params");
    // Every parameter holds this rank's rows only; the shards add up to the model.
    int64_t local = 0, full = 0;
    for (auto& p : strat->module()->parameters()) local += p.numel();
    for (auto& p : make_model()->parameters()) full += p.numel();
    const int S = fsdp->shard_comm()->size();
    WCHECK(fsdp->shard_comm()->all_reduce_int(local) == full, kind, ": shards do not add up to ", full);
    if (S > 1) WCHECK(local < full, kind, ": rank holds ", local, " of ", full, " elements");
  }
  Trace t;
  g_block_forwards = 0;
  std::vector<const void*> grad_ptrs;  // DDP: where each .grad lives after the first step
  bool grads_survive_zero_grad = true;  // Optimizer::zero_grad zeroes in place (1.13) or drops (2.x)
  for (int s = 0; s < steps; ++s) {
    auto [gx, gy] = global_batch(s);
    at::Tensor x = rows_of(gx, c->rank(), c->size()), y = rows_of(gy, c->rank(), c->size());
    double loss_sum = 0;
    for (int k = 0; k < micro; ++k) {
      at::Tensor xm = rows_of(x, k, micro), ym = rows_of(y, k, micro);
      at::Tensor loss = at::mse_loss(m.forward(xm), ym);
      loss_sum += loss.item<double>() / micro;
      if (k + 1 < micro) {
        auto guard = strat->no_sync();
        strat->backward(loss / micro);
      } else {
        strat->backward(loss / micro);
      }
    }
    t.losses.push_back(c->all_reduce_double(loss_sum, distributed::ReduceOp::Avg));
    if (clip > 0) t.norms.push_back(strat->clip_grad_norm(clip));
    if (fsdp) WCHECK(!fsdp->any_gathered(), kind, ": parameters still gathered after backward");
    if (ddp && kind == "ddp_small_buckets" && n > 1 && micro == 1)
      WCHECK(ddp->launched_during_backward() >= 1, kind, ": no bucket all-reduce started during backward (of ",
             ddp->buckets().size(), " buckets)");
    if (ddp) {
      // Gradients stay in place from the first step on; by default in their bucket's
      // buffer: no allocation and no copy back per step (and zero_grad can still detach
      // them).
      std::vector<const void*> ptrs;
      for (auto& p : strat->module()->parameters()) ptrs.push_back(p.grad().defined() ? p.grad().data_ptr() : nullptr);
      if (s == 0) grad_ptrs = ptrs;
      // With gradient_as_bucket_view the gradients come back into their bucket even after
      // a zero_grad that drops them (libtorch 2.x: set_to_none by default); a gradient of
      // its own stays in place only where zero_grad keeps it (1.13: zeroed in place).
      if (ddp->options().gradient_as_bucket_view || grads_survive_zero_grad)
        WCHECK(ptrs == grad_ptrs, kind, ": a gradient moved at step ", s);
      // ... and a bucket's gradients are consecutive stretches of one buffer (or, with
      // gradient_as_bucket_view off, not: each .grad keeps its own tensor).
      auto named = strat->module()->named_parameters();
      const bool as_view = ddp->options().gradient_as_bucket_view;
      for (auto& bucket : ddp->buckets()) {
        for (size_t k = 1; k < bucket.size(); ++k) {
          const at::Tensor& a = named[bucket[k - 1]].grad();
          const at::Tensor& b = named[bucket[k]].grad();
          const bool adjacent = static_cast<const char*>(a.data_ptr()) + a.nbytes() == b.data_ptr();
          WCHECK(adjacent == as_view, kind, ": gradients of ", bucket[k - 1], " and ", bucket[k],
                 as_view ? " are not adjacent in their bucket" : " alias the bucket although the option is off");
        }
      }
    }
    strat->optimizer_step(*opt);
    opt->zero_grad();
    if (s == 0)
      for (auto& p : strat->module()->parameters()) grads_survive_zero_grad = grads_survive_zero_grad && p.grad().defined();
    t.evals.push_back(eval_loss([&](const at::Tensor& x) { return m.forward(x); }));
    if (fsdp) WCHECK(!fsdp->any_gathered(), kind, ": parameters still gathered after a no-grad forward");
  }
  // Activation checkpointing runs each block's forward again in backward; the no-grad
  // evaluation after each step runs each block once more.
  const int64_t want_forwards = 2 * steps * micro * (kind == "full_ckpt" ? 2 : 1) + 2 * steps;
  WCHECK(g_block_forwards == want_forwards, kind, ": ", g_block_forwards, " block forwards, expected ", want_forwards);
  if (fsdp && fsdp->options().prefetch && fsdp->shard_comm()->size() > 1)
    WCHECK(fsdp->prefetches() > 0, kind, ": no prefetch issued");
  if (ddp && kind == "ddp_small_buckets") WCHECK(ddp->buckets().size() >= 3, kind, ": ", ddp->buckets().size(), " buckets");
  auto sd = strat->module_state(StateDictType::Full);
  for (auto& key : sd.keys()) t.params[key] = sd.tensor(key);
  if (out_strategy) *out_strategy = strat.get();
  if (keep) *keep = std::move(strat);
  return t;
}

void compare(const Trace& got, const Trace& want, const std::string& what, double tol) {
  WCHECK(got.losses.size() == want.losses.size(), what);
  double worst = 0;
  for (size_t s = 0; s < want.losses.size(); ++s) {
    double r = rel(got.losses[s], want.losses[s]);
    worst = std::max(worst, r);
    WCHECK(r <= tol, what, ": step ", s, " loss ", got.losses[s], " vs single-process ", want.losses[s], " (rel ", r, ")");
  }
  WCHECK(got.evals.size() == want.evals.size(), what, ": ", got.evals.size(), " evaluations vs ", want.evals.size());
  for (size_t s = 0; s < want.evals.size(); ++s) {
    double r = rel(got.evals[s], want.evals[s]);
    worst = std::max(worst, r);
    WCHECK(r <= tol, what, ": no-grad evaluation after step ", s, " loss ", got.evals[s], " vs single-process ",
           want.evals[s], " (rel ", r, ")");
  }
  for (size_t s = 0; s < want.norms.size(); ++s) {
    double r = rel(got.norms[s], want.norms[s]);
    WCHECK(r <= tol, what, ": step ", s, " grad norm ", got.norms[s], " vs single-process ", want.norms[s]);
  }
  WCHECK(got.params.size() == want.params.size(), what, ": ", got.params.size(), " params vs ", want.params.size());
  double worst_p = 0;
  for (auto& [k, v] : want.params) {
    auto it = got.params.find(k);
    WCHECK(it != got.params.end(), what, ": missing parameter ", k);
    WCHECK(it->second.sizes() == v.sizes(), what, ": ", k, " shape ", it->second.sizes(), " vs ", v.sizes());
    double r = rel(it->second, v);
    worst_p = std::max(worst_p, r);
    WCHECK(r <= tol, what, ": final parameter ", k, " differs (rel ", r, ")");
  }
  std::printf("%s: max rel loss diff %.3g, max rel param diff %.3g\n", what.c_str(), worst, worst_p);
}

}  // namespace

// args: comma-separated strategy kinds, steps, clip (0: none), micro-batches.
SCENARIO("strategy_parity") {
  at::set_num_threads(1);
  const auto kinds = args.list_arg(0, "ddp");
  const int steps = static_cast<int>(args.int_arg(1, 50));
  const double clip = std::stod(args.arg(2, "0"));
  const int micro = static_cast<int>(args.int_arg(3, 1));
  const double lr = 1e-2;
  Trace want = reference(steps, clip, lr);
  if (clip > 0) {
    int clipped = 0;
    for (double n : want.norms) clipped += n > clip;
    WCHECK(clipped > 0 && clipped < steps, "clip threshold ", clip, " never/always clips; test not meaningful");
  }
  for (auto& kind : kinds) {
    Trace got = train(kind, steps, clip, lr, micro);
    compare(got, want, concat(kind, " n=", comm()->size(), " rank ", comm()->rank()), 1e-5);
  }
  std::printf("parity ok rank %d\n", comm()->rank());
  return 0;
}

// bf16 compute parameters gathered in bf16 (fp32 master shards and Adam state),
// gradients reduced in fp32 or bf16; tracks the fp32 single-process run.
SCENARIO("strategy_bf16") {
  at::set_num_threads(1);
  auto c = comm();
  const int steps = 20;
  const double tol = 1e-2;  // relative, per-step loss (measured: about 1e-3)
  Trace want = reference(steps, 0, 1e-2);
  for (bool bf16_reduce : {false, true}) {
    FsdpOptions o;
    o.auto_wrap = wrap_by_type<BlockImpl>();
    o.mixed_precision.param_dtype = at::kBFloat16;
    if (bf16_reduce) o.mixed_precision.reduce_dtype = at::kBFloat16;
    FsdpStrategy strat(c, o);
    auto m = strat.setup(make_model());
    torch::optim::Adam opt(strat.module()->parameters(), torch::optim::AdamOptions(1e-2));
    std::vector<double> losses;
    g_seen_weight_dtype = at::kFloat;
    train_steps(strat, m, opt, 0, steps, &losses);
    WCHECK(g_seen_weight_dtype == at::kBFloat16, "blocks computed with ", g_seen_weight_dtype, " weights");
    for (auto& p : strat.module()->parameters()) WCHECK(p.scalar_type() == at::kFloat, "master shard is ", p.scalar_type());
    double worst = 0;
    for (int s = 0; s < steps; ++s) {
      const double r = rel(losses[s], want.losses[s]);
      worst = std::max(worst, r);
      WCHECK(r <= tol, "bf16 step ", s, " loss ", losses[s], " vs fp32 ", want.losses[s]);
    }
    WCHECK(losses.back() < losses.front() * 0.9, "bf16 training did not reduce the loss");
    std::printf("bf16 reduce=%s n=%d: max rel loss diff vs fp32 %.3g\n", bf16_reduce ? "bf16" : "fp32", c->size(), worst);
  }
  std::printf("bf16 ok rank %d\n", c->rank());
  return 0;
}

// A float64 model stays float64 under FSDP: gathered, computed and reduced in its own
// dtype. 5 Adam steps (full shard and no-sync accumulation) match one float64 process
// to 1e-12, far below the ~1e-7 that a float32 round trip anywhere would leave.
SCENARIO("strategy_fp64") {
  at::set_num_threads(1);
  auto c = comm();
  const int steps = 5;
  auto batch = [](int s) {
    auto [x, y] = global_batch(s);
    return std::make_pair(x.to(at::kDouble), y.to(at::kDouble));
  };
  std::vector<double> want;
  std::map<std::string, at::Tensor> want_params;
  {
    auto model = make_model();
    model->to(at::kDouble);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    for (int s = 0; s < steps; ++s) {
      auto [x, y] = batch(s);
      at::Tensor loss = at::mse_loss(model->forward(x), y);
      loss.backward();
      want.push_back(loss.item<double>());
      opt.step();
      opt.zero_grad();
    }
    for (auto& kv : model->named_parameters()) want_params[kv.key()] = kv.value().detach().clone();
  }
  FsdpOptions o;
  o.auto_wrap = wrap_by_type<BlockImpl>();
  FsdpStrategy strat(c, o);
  auto model = make_model();
  model->to(at::kDouble);
  auto m = strat.setup(model);
  torch::optim::Adam opt(strat.module()->parameters(), torch::optim::AdamOptions(1e-2));
  for (int s = 0; s < steps; ++s) {
    auto [gx, gy] = batch(s);
    at::Tensor x = rows_of(gx, c->rank(), c->size()), y = rows_of(gy, c->rank(), c->size());
    double loss_sum = 0;
    {
      // Two micro-batches, the first without gradient sync.
      auto guard = strat.no_sync();
      at::Tensor l = at::mse_loss(m.forward(x.narrow(0, 0, x.size(0) / 2)), y.narrow(0, 0, x.size(0) / 2)) / 2;
      strat.backward(l);
      loss_sum += l.item<double>();
    }
    at::Tensor l = at::mse_loss(m.forward(x.narrow(0, x.size(0) / 2, x.size(0) / 2)),
                                y.narrow(0, x.size(0) / 2, x.size(0) / 2)) / 2;
    strat.backward(l);
    loss_sum += l.item<double>();
    const double loss = c->all_reduce_double(loss_sum, distributed::ReduceOp::Avg);
    WCHECK(rel(loss, want[s]) <= 1e-12, "float64 step ", s, " loss ", loss, " vs ", want[s], " (rel ",
           rel(loss, want[s]), ")");
    strat.optimizer_step(opt);
    opt.zero_grad();
  }
  for (auto& p : strat.module()->parameters()) WCHECK(p.scalar_type() == at::kDouble, "a shard is ", p.scalar_type());
  auto sd = strat.module_state(StateDictType::Full);
  for (auto& [k, v] : want_params) {
    WCHECK(sd.tensor(k).scalar_type() == at::kDouble, k, " is ", sd.tensor(k).scalar_type());
    WCHECK(rel(sd.tensor(k), v) <= 1e-12, k, " differs by ", rel(sd.tensor(k), v));
  }
  std::printf("fp64 ok rank %d\n", c->rank());
  return 0;
}

// Units made explicitly through init_module (deferred, unit-by-unit sharding) in a
// custom module: same training as single process.
SCENARIO("strategy_explicit_units") {
  at::set_num_threads(1);
  auto c = comm();
  const int steps = 10;
  Trace want = reference(steps, 0, 1e-2);
  FsdpStrategy strat(c, FsdpOptions{});
  Net net(strat);
  // Each block was sharded the moment it was built: this rank holds about 1/N of
  // block 1's 433 elements (the cut between ranks moves to a row boundary, so up to
  // one row more than the even split), and the pieces' rows add up to whole parameters.
  {
    int64_t local = 0, full = 0, widest_row = 0;
    for (auto& kv : net->named_parameters()) {
      if (kv.key().rfind("1.", 0) != 0) continue;
      const at::Tensor& p = kv.value();
      const int64_t row_numel = p.dim() > 1 ? p.stride(0) : 1;
      local += p.numel();
      full += c->all_reduce_int(p.size(0)) * row_numel;
      widest_row = std::max(widest_row, row_numel);
    }
    WCHECK(full == 433, "block 1's pieces add up to ", full, " elements, the block has 433");
    WCHECK(local <= full / c->size() + widest_row, "rank ", c->rank(), " holds ", local, " of block 1's ", full,
           " elements right after init: not sharded unit by unit");
  }
  auto m = strat.setup(torch::nn::AnyModule(net));
  WCHECK(strat.num_units() == 3, strat.num_units(), " units");
  torch::optim::Adam opt(strat.module()->parameters(), torch::optim::AdamOptions(1e-2));
  std::vector<double> losses, evals;
  train_steps(strat, m, opt, 0, steps, &losses, &evals);
  for (int s = 0; s < steps; ++s) {
    WCHECK(rel(losses[s], want.losses[s]) <= 1e-5, "step ", s, " loss ", losses[s], " vs ", want.losses[s]);
    WCHECK(rel(evals[s], want.evals[s]) <= 1e-5, "no-grad evaluation after step ", s, ": ", evals[s], " vs ",
           want.evals[s]);
  }
  WCHECK(!strat.any_gathered(), "parameters still gathered after a no-grad forward");
  // One more step, counting all-gathers: the root and both blocks before their
  // forward, then the first block again for its backward. The root is kept through
  // backward, and so is the second block (backward starts with it).
  const int64_t g0 = strat.gathers();
  {
    auto [gx, gy] = global_batch(steps);
    at::Tensor loss = at::mse_loss(m.forward(rows_of(gx, c->rank(), c->size())), rows_of(gy, c->rank(), c->size()));
    WCHECK(strat.any_gathered() == (c->size() > 1), "gathered between forward and backward: ", strat.any_gathered());
    strat.backward(loss);
    opt.zero_grad();
  }
  const int64_t per_step = strat.gathers() - g0;
  WCHECK(per_step == (c->size() > 1 ? 4 : 0), per_step, " all-gathers in one step at world size ", c->size());
  WCHECK(!strat.any_gathered(), "parameters still gathered after backward");
  auto sd = strat.module_state(StateDictType::Full);
  for (auto& [k, v] : want.params) WCHECK(rel(sd.tensor(k), v) <= 1e-5, k);
  std::printf("explicit units ok rank %d\n", c->rank());
  return 0;
}
