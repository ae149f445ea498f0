// Rank programs that check what the strategies do rather than only what they compute
// (the parity tests in strategy_parity_scenarios.cpp would pass if no_sync, SHARD_GRAD_OP or
// CPU offload were ignored): collectives counted per kind, where tensors live and what is
// kept between steps, and DDP's find_unused_parameters with ranks using different
// parameters.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <cstdio>
#include <map>
#include <optional>
#include <set>

#include "support/scenario.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::strategy;

namespace {

// What the first Mlp forward since the last reset saw of its first weight (FSDP swaps
// the data in and out).
struct Seen {
  std::vector<int64_t> shape;
  c10::Device device = c10::kCPU;
  const void* ptr = nullptr;  // where its data was then
  at::Tensor data;            // a second handle on that data (its storage may be freed later)
} g_seen;

struct MlpImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  MlpImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (!g_seen.data.defined())
      g_seen = {a->weight.sizes().vec(), a->weight.device(), a->weight.data_ptr(), a->weight.detach()};
    return x + b(at::tanh(a(x)));
  }
};
TORCH_MODULE(Mlp);

// Root (the two Linears) + two Mlp units under the wrap policy: three units.
torch::nn::Sequential make_net() {
  at::manual_seed(3);
  torch::nn::Linear in(5, 8);
  Mlp m0, m1;
  torch::nn::Linear head(8, 3);
  return torch::nn::Sequential(in, m0, m1, head);
}

std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::detail::createCPUGenerator(500 + 10 * step + rank);
  return {at::randn({6, 5}, gen), at::randn({6, 3}, gen)};
}

std::unique_ptr<Strategy> make(const std::string& kind, std::shared_ptr<distributed::Communicator> c) {
  if (kind == "ddp") return std::make_unique<DdpStrategy>(c);
  FsdpOptions o;
  o.auto_wrap = wrap_by_type<MlpImpl>();
  if (kind == "full") o.sharding = ShardingStrategy::FullShard;
  else if (kind == "grad_op") o.sharding = ShardingStrategy::ShardGradOp;
  else if (kind == "no_shard") o.sharding = ShardingStrategy::NoShard;
  else if (kind == "full_offload") o.cpu_offload = true;
  else throw Error("unknown strategy kind " + kind);
  return std::make_unique<FsdpStrategy>(c, o);
}

// Sums of the counts of every distinct communicator in `comms`.
distributed::Communicator::Counts sum_counts(const std::vector<std::shared_ptr<distributed::Communicator>>& comms) {
  std::set<distributed::Communicator*> seen;
  distributed::Communicator::Counts s;
  for (auto& k : comms) {
    if (!seen.insert(k.get()).second) continue;
    auto x = k->counts();
    s.all_reduce += x.all_reduce;
    s.all_gather += x.all_gather;
    s.reduce_scatter += x.reduce_scatter;
    s.broadcast += x.broadcast;
    s.all_to_all += x.all_to_all;
  }
  return s;
}

distributed::Communicator::Counts minus(const distributed::Communicator::Counts& a, const distributed::Communicator::Counts& b) {
  return {a.all_reduce - b.all_reduce, a.all_gather - b.all_gather, a.reduce_scatter - b.reduce_scatter,
          a.broadcast - b.broadcast, a.all_to_all - b.all_to_all};
}

}  // namespace

// Per step: one micro-batch under no_sync(), then a synced one. Counted on the
// communicators the strategy's collectives go through:
//  - under no_sync no gradient collective at all (no reduce-scatter, no all-reduce);
//  - the synced backward reduces each of the 3 FSDP units once (NO_SHARD: a reduce-scatter
//    on its one-rank shard group and an all-reduce across ranks per unit), DDP each bucket;
//  - all-gathers per forward+backward once the forward order is known: FULL_SHARD 4 (the
//    root and both Mlps before their forward, the first Mlp again before its backward; the
//    last Mlp is kept, backward starts with it), SHARD_GRAD_OP 3 (nothing re-gathered),
//    NO_SHARD none.
SCENARIO("strategy_collective_counts") {
  at::set_num_threads(1);
  auto c = comm();
  const int n = c->size();
  WCHECK(n >= 2, "needs at least 2 ranks, got ", n);
  std::map<std::string, int64_t> gathers;
  for (std::string kind : {"full", "grad_op", "no_shard", "ddp"}) {
    auto strat = make(kind, c);
    auto m = strat->setup(make_net());
    auto* fsdp = dynamic_cast<FsdpStrategy*>(strat.get());
    auto* ddp = dynamic_cast<DdpStrategy*>(strat.get());
    const std::vector<std::shared_ptr<distributed::Communicator>> comms =
        fsdp ? std::vector<std::shared_ptr<distributed::Communicator>>{fsdp->shard_comm(), fsdp->replicate_comm()}
             : std::vector<std::shared_ptr<distributed::Communicator>>{c};
    torch::optim::Adam opt(strat->module()->parameters(), torch::optim::AdamOptions(1e-2));
    for (int step = 0; step < 3; ++step) {
      for (int micro = 0; micro < 2; ++micro) {
        auto [x, y] = batch(2 * step + micro, c->rank());
        const bool synced = micro == 1;
        const auto before = sum_counts(comms);
        {
          std::optional<NoSyncGuard> guard;
          if (!synced) guard.emplace(strat->no_sync());
          strat->backward(at::mse_loss(m.forward(x), y) / 2);
        }
        const auto d = minus(sum_counts(comms), before);
        const std::string where = concat(kind, " step ", step, synced ? " synced" : " under no_sync", ": ");
        if (!synced) {
          WCHECK(d.reduce_scatter == 0 && d.all_reduce == 0, where, d.reduce_scatter, " reduce-scatters and ",
                 d.all_reduce, " all-reduces (gradients must stay local)");
        } else if (ddp) {
          const auto buckets = static_cast<int64_t>(ddp->buckets().size());
          WCHECK(d.all_reduce == buckets && d.reduce_scatter == 0, where, d.all_reduce, " all-reduces for ", buckets,
                 " buckets, ", d.reduce_scatter, " reduce-scatters");
        } else {
          const int64_t ar = kind == "no_shard" ? 3 : 0;
          WCHECK(d.reduce_scatter == 3 && d.all_reduce == ar, where, d.reduce_scatter, " reduce-scatters and ",
                 d.all_reduce, " all-reduces, expected 3 and ", ar);
        }
        WCHECK(d.broadcast == 0 && d.all_to_all == 0, where, d.broadcast, " broadcasts, ", d.all_to_all,
               " all-to-alls");
        if (fsdp && (step > 0 || micro > 0)) {
          WCHECK(!gathers.count(kind) || gathers[kind] == d.all_gather, where, d.all_gather,
                 " all-gathers, an earlier step had ", gathers[kind]);
          gathers[kind] = d.all_gather;
        }
        if (fsdp) WCHECK(!fsdp->any_gathered(), where, "parameters still gathered after backward");
      }
      strat->optimizer_step(opt);
      opt.zero_grad();
    }
    std::printf("%s n=%d: %lld all-gathers per forward+backward\n", kind.c_str(), n,
                static_cast<long long>(gathers.count(kind) ? gathers[kind] : 0));
  }
  WCHECK(gathers["full"] == 4, "FULL_SHARD: ", gathers["full"], " all-gathers per step, expected 4");
  WCHECK(gathers["grad_op"] == 3, "SHARD_GRAD_OP: ", gathers["grad_op"], " all-gathers per step, expected 3");
  WCHECK(gathers["no_shard"] == 0, "NO_SHARD: ", gathers["no_shard"], " all-gathers per step, expected 0");
  std::printf("collective counts ok rank %d\n", c->rank());
  return 0;
}

// CPU offload on a CPU-only machine (offload device == compute device): what can still
// be told apart is what is kept. Between steps every parameter holds its master shard
// (on the CPU; this rank's rows only), the copy the unit computed with was a different
// buffer, gathered for the step and freed after it (even on one rank, where without
// offload the parameters simply stay whole and nothing is gathered); gradients and Adam
// state are shard-shaped and on the CPU.
SCENARIO("strategy_offload_placement") {
  at::set_num_threads(1);
  auto c = comm();
  const int n = c->size();
  for (std::string kind : {"full_offload", "full"}) {
    const bool offload = kind == "full_offload";
    auto strat = make(kind, c);
    auto& fsdp = dynamic_cast<FsdpStrategy&>(*strat);
    WCHECK(fsdp.options().cpu_offload == offload, kind);
    auto m = strat->setup(make_net());
    auto named = strat->module()->named_parameters();
    torch::optim::Adam opt(strat->module()->parameters(), torch::optim::AdamOptions(1e-2));
    int64_t full = 0;
    for (auto& p : make_net()->parameters()) full += p.numel();
    std::map<std::string, const void*> masters;
    for (auto& kv : named) masters[kv.key()] = kv.value().data_ptr();
    // Two units at least gather whenever there is more than one rank, or with offload.
    const bool gathers = n > 1 || offload;
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = batch(step, c->rank());
      const auto g0 = c->counts().all_gather;
      g_seen = {};
      strat->backward(at::mse_loss(m.forward(x), y));
      const auto g = c->counts().all_gather - g0;
      const std::string where = concat(kind, " n=", n, " step ", step, ": ");
      WCHECK(g_seen.shape == std::vector<int64_t>({8, 8}), where, "the unit computed with a weight of shape ",
             at::IntArrayRef(g_seen.shape));
      WCHECK(g_seen.device == fsdp.options().device, where, "computed on ", g_seen.device);
      WCHECK((g > 0) == gathers && (fsdp.gathers() > 0) == gathers, where, g, " all-gathers");
      // The compute copy was not the master, and its memory is released after the step.
      WCHECK((g_seen.ptr != masters["1.a.weight"]) == gathers, where,
             "the unit computed on the master shard's memory: ", gathers ? "not gathered" : "gathered");
      if (gathers)
        WCHECK(g_seen.data.storage().nbytes() == 0, where, "the gathered weight still holds ",
               g_seen.data.storage().nbytes(), " bytes after backward");
      WCHECK(!fsdp.any_gathered(), where, "parameters gathered after backward");
      int64_t local = 0;
      for (auto& kv : named) {
        const at::Tensor& p = kv.value();
        const std::string what = concat(where, kv.key());
        WCHECK(p.device().is_cpu() && p.data_ptr() == masters[kv.key()], what, " does not hold its master shard");
        WCHECK(p.grad().defined() && p.grad().device().is_cpu() && p.grad().sizes() == p.sizes(), what,
               " has no shard-shaped CPU gradient");
        local += p.numel();
      }
      WCHECK(c->all_reduce_int(local) == full && (n == 1 || local < full), where, local, " of ", full,
             " elements held here");
      strat->optimizer_step(opt);
      opt.zero_grad();
    }
    // Adam state: one entry per parameter, on the CPU, the shards' size (twice over).
    int64_t state_bytes = 0;
    for (auto& kv : opt.state()) {
      auto* st = dynamic_cast<torch::optim::AdamParamState*>(kv.second.get());
      WCHECK(st && st->exp_avg().device().is_cpu() && st->exp_avg_sq().device().is_cpu(), kind,
             ": Adam state missing or not on the CPU");
      state_bytes += static_cast<int64_t>(st->exp_avg().nbytes() + st->exp_avg_sq().nbytes());
    }
    WCHECK(opt.state().size() == named.size(), kind, ": Adam state for ", opt.state().size(), " of ", named.size(),
           " parameters");
    WCHECK(state_bytes == 2 * fsdp.local_param_bytes(), kind, ": Adam state ", state_bytes, " bytes, shards ",
           fsdp.local_param_bytes());
  }
  std::printf("offload placement ok rank %d\n", c->rank());
  return 0;
}

namespace {

// `shared` feeds one of two heads chosen per rank and step; `never` is used by no rank.
struct BranchNetImpl : torch::nn::Module {
  torch::nn::Linear shared{nullptr}, head0{nullptr}, head1{nullptr}, never{nullptr};
  int branch = 0;
  BranchNetImpl() {
    at::manual_seed(11);
    shared = register_module("shared", torch::nn::Linear(3, 4));
    head0 = register_module("head0", torch::nn::Linear(4, 2));
    head1 = register_module("head1", torch::nn::Linear(4, 2));
    never = register_module("never", torch::nn::Linear(4, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(shared(x));
    return branch == 0 ? head0(h) : head1(h);
  }
};
TORCH_MODULE(BranchNet);

// Gradients of one plain process on `x` through `branch` (undefined: not used).
std::map<std::string, at::Tensor> local_grads(const at::Tensor& x, int branch) {
  BranchNet net;
  net->branch = branch;
  net->forward(x).pow(2).sum().backward();
  std::map<std::string, at::Tensor> g;
  for (auto& kv : net->named_parameters()) g[kv.key()] = kv.value().grad();
  return g;
}

}  // namespace

// DDP with find_unused_parameters on 2 ranks that use different heads: each head's
// gradient is the average over ranks with zero where unused (so half of one rank's),
// `shared` the average of both, and `never` has no gradient on any rank. Three steps
// with the heads swapped in between, gradients zeroed in place and then set to none.
SCENARIO("ddp_unused_parameters") {
  at::set_num_threads(1);
  auto c = comm();
  WCHECK(c->size() == 2, "needs 2 ranks, got ", c->size());
  DdpOptions o;
  o.find_unused_parameters = true;
  o.bucket_cap_bytes = 40;  // about one parameter per bucket: heads and shared in different buckets
  DdpStrategy ddp(c, o);
  BranchNet net;
  auto m = ddp.setup(torch::nn::AnyModule(net));
  WCHECK(ddp.buckets().size() >= 4, ddp.buckets().size(), " buckets");
  for (int step = 0; step < 3; ++step) {
    const int mine = (c->rank() + step) % 2;  // rank 0 uses head0, then head1, then head0
    at::Tensor xs[2];
    for (int r = 0; r < 2; ++r) xs[r] = at::randn({5, 3}, at::detail::createCPUGenerator(70 + 2 * step + r));
    net->branch = mine;
    ddp.backward(m.forward(xs[c->rank()]).pow(2).sum());
    // Both ranks' gradients, computed here in one process (parameters do not change).
    auto g0 = local_grads(xs[0], (0 + step) % 2), g1 = local_grads(xs[1], (1 + step) % 2);
    for (auto& kv : net->named_parameters()) {
      const std::string& k = kv.key();
      const at::Tensor& got = kv.value().grad();
      const std::string where = concat("step ", step, " rank ", c->rank(), " ", k);
      if (!g0[k].defined() && !g1[k].defined()) {
        WCHECK(!got.defined(), where, ": used by no rank but has a gradient");
        continue;
      }
      at::Tensor want = ((g0[k].defined() ? g0[k] : at::zeros_like(kv.value())) +
                         (g1[k].defined() ? g1[k] : at::zeros_like(kv.value()))) / 2;
      WCHECK(got.defined(), where, ": no gradient");
      WCHECK(at::allclose(got, want, 1e-5, 1e-6), where, ": gradient ", got, " expected ", want);
    }
    WCHECK(!g0["never.weight"].defined() && !g1["never.weight"].defined(), "'never' is used");
    for (auto& p : net->parameters()) {
      if (!p.grad().defined()) continue;
      if (step == 0) p.mutable_grad().zero_();  // kept, zeroed in place (the bucket alias)
      else p.mutable_grad() = at::Tensor();     // set to none
    }
  }
  std::printf("ddp unused ok rank %d\n", c->rank());
  return 0;
}
