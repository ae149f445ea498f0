// Rank programs for the tensor-parallel tests: the GPT example's model on a (dp, tp) mesh,
// tensor parallel inside, DDP or FSDP over the data-parallel dimension, trained against
// the same model in one process on the same global batch (computed in-process by every
// rank: the model is tiny); and the collectives one block issues per step.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cstdio>
#include <functional>

#include "../../examples/gpt/model.h"
#include "support/scenario.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/parallel/mesh.h"
#include "tessera/parallel/plan.h"
#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"
#include "tessera/strategy/factory.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

constexpr int64_t kGlobalBatch = 4;

// At tp 3 the vocabulary (256) does not divide: pieces of 86, 86 and 84 rows.
gpt::Config small_config(bool tied, int tp) {
  gpt::Config c;
  c.n_layer = 2;
  c.n_head = tp == 3 ? 3 : 4;
  c.d_model = tp == 3 ? 24 : 32;
  c.seq_len = tp == 3 ? 12 : 16;
  c.tie_weights = tied;
  return c;
}

// The global batch of step s: [kGlobalBatch, seq_len] byte tokens and their next bytes.
std::pair<at::Tensor, at::Tensor> batch(int step, int64_t seq_len) {
  auto gen = at::detail::createCPUGenerator(500 + step);
  at::Tensor t = at::randint(gpt::kVocab, {kGlobalBatch, seq_len + 1}, gen, at::kLong);
  return {t.narrow(1, 0, seq_len).contiguous(), t.narrow(1, 1, seq_len).contiguous()};
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }

struct Run {
  std::vector<double> losses, norms;
  state::StateDict full;  // the module's full state dict after the last step
};

constexpr double kLr = 3e-3, kClip = 0.5;

Run reference(const gpt::Config& c, int steps) {
  at::manual_seed(11);
  gpt::Gpt model(c);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(kLr));
  Run r;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, c.seq_len);
    at::Tensor loss = model->loss(model->forward(x), y);
    loss.backward();
    r.losses.push_back(loss.item<double>());
    r.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), kClip));
    opt.step();
    opt.zero_grad();
  }
  r.full = state::state_dict(*model);
  return r;
}

// `kind` "ddp", "fsdp" or "hsdp" (FSDP's HYBRID_SHARD in two replica groups: a 3-D mesh) over
// the mesh's dp dimension, tensor parallel over its tp one; "fsdp-bf16": bf16 compute
// parameters (fp32 masters and reductions);
// "fsdp-ckpt": with activation checkpointing (each block's forward recomputed, its TP
// collectives with it); "ddp-accum" / "fsdp-accum": each rank's batch in two micro-batches,
// the first under no_sync (gradient accumulation; the TP collectives still run).
Run on_mesh(const std::string& kind_in, int tp_size, bool sp, bool tied, int steps) {
  const std::string kind = kind_in.substr(0, kind_in.find('-'));
  const bool ckpt = kind_in == "fsdp-ckpt", accum = kind_in.size() > 6 && kind_in.substr(kind_in.size() - 6) == "-accum";
  auto world = comm();
  const int dp_size = world->size() / tp_size;
  parallel::DeviceMesh mesh(world, {{"dp", dp_size}, {"tp", tp_size}});
  gpt::Config c = small_config(tied, tp_size);
  c.tp = parallel::TensorParallel::from_mesh(mesh, "tp", sp);
  std::unique_ptr<strategy::Strategy> strat;
  if (kind == "ddp") {
    strat = std::make_unique<strategy::DdpStrategy>(mesh.comm("dp"));
  } else {
    strategy::FsdpOptions o;
    o.auto_wrap = strategy::wrap_by_type<gpt::BlockImpl>();
    o.activation_checkpointing = ckpt;
    if (kind == "hsdp") {  // (replicate 2, shard dp / 2, tp): two replica groups
      o.sharding = strategy::ShardingStrategy::HybridShard;
      o.ranks_per_node = std::max(1, dp_size / 2);
    }
    if (kind_in == "fsdp-bf16") o.mixed_precision.param_dtype = at::kBFloat16;
    strat = std::make_unique<strategy::FsdpStrategy>(mesh.comm("dp"), o);
  }
  at::manual_seed(11);
  gpt::Gpt model(c);
  auto m = strat->setup(torch::nn::AnyModule(model));
  auto opt = std::make_shared<torch::optim::AdamW>(strat->module()->parameters(), torch::optim::AdamWOptions(kLr));
  strat->add_optimizer(opt);
  WCHECK(strat->tensor_parallel_comm() == (tp_size > 1 ? mesh.comm("tp") : nullptr), "the strategy found the group");
  const int64_t per = kGlobalBatch / dp_size;
  const int dp_rank = mesh.coordinate("dp");
  Run r;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = batch(s, c.seq_len);
    at::Tensor xs = x.narrow(0, dp_rank * per, per), ys = y.narrow(0, dp_rank * per, per);
    at::Tensor loss;
    if (accum) {  // two halves, mean of their losses: the same gradient as the whole batch
      const int64_t half = per / 2;
      {
        auto guard = strat->no_sync();
        at::Tensor l0 = model->loss(m.forward(xs.narrow(0, 0, half)), ys.narrow(0, 0, half)) * 0.5;
        strat->backward(l0);
        loss = l0.detach();
      }
      at::Tensor l1 = model->loss(m.forward(xs.narrow(0, half, per - half)), ys.narrow(0, half, per - half)) * 0.5;
      strat->backward(l1);
      loss = loss + l1.detach();
    } else {
      loss = model->loss(m.forward(xs), ys);
      strat->backward(loss);
    }
    // The global batch's mean loss: the mean of the data-parallel ranks' (equal batches).
    r.losses.push_back(mesh.comm("dp")->all_reduce_double(loss.item<double>()) / dp_size);
    r.norms.push_back(strat->clip_grad_norm(kClip));
    strat->optimizer_step(*opt);
    opt->zero_grad();
  }
  r.full = strat->module_state(strategy::StateDictType::Full);
  return r;
}

// Every step's loss within `tol` (relative), its gradient norm within 10x that, and the
// final global parameters (below).
void expect_same(const Run& got, const Run& want, const std::string& what, double tol) {
  WCHECK(got.losses.size() == want.losses.size(), what);
  for (size_t s = 0; s < want.losses.size(); ++s) {
    WCHECK(rel(got.losses[s], want.losses[s]) <= tol, what, ": step ", s, " loss ", got.losses[s], " vs ",
           want.losses[s]);
    // The norm drifts faster than the loss (it is a derivative); a miscount of the
    // replicated or cut parameters would be off by far more than 10x.
    WCHECK(rel(got.norms[s], want.norms[s]) <= 10 * tol, what, ": step ", s, " gradient norm ", got.norms[s], " vs ",
           want.norms[s]);
  }
  // The final weights: the whole model within 10x the step tolerance (relative norm), each
  // tensor within 1e-3. Per tensor it is looser because the key bias (qkv.bias's middle
  // third) has no gradient in exact arithmetic (softmax ignores a shift shared by a row), so
  // Adam's normalised step turns rounding noise into updates of lr's size there.
  WCHECK(got.full.keys() == want.full.keys(), what, ": the state dict's keys differ from the plain model's");
  double diff2 = 0, norm2 = 0;
  for (const auto& k : want.full.keys()) {
    const at::Tensor& a = got.full.tensor(k);
    const at::Tensor& b = want.full.tensor(k);
    WCHECK(a.sizes() == b.sizes(), what, ": '", k, "' has shape ", a.sizes(), ", the plain model's ", b.sizes());
    const double d = (a - b).norm().item<double>(), n = b.norm().item<double>();
    WCHECK(d <= 1e-3 * std::max(n, 1e-12), what, ": '", k, "' differs by ", d / n, " (relative norm)");
    diff2 += d * d;
    norm2 += n * n;
  }
  WCHECK(std::sqrt(diff2 / norm2) <= 10 * tol, what, ": the weights differ by ", std::sqrt(diff2 / norm2),
         " (relative norm of the whole model)");
}

}  // namespace

// tp_parity KINDS TP CONFIGS STEPS: for each strategy kind (ddp, fsdp) and each config
// (sp|nosp)-(tied|untied), training on the (world/TP, TP) mesh matches one process.
SCENARIO("tp_parity") {
  const auto kinds = args.list_arg(0, "ddp,fsdp");
  const int tp = static_cast<int>(args.int_arg(1, 2));
  const auto configs = args.list_arg(2, "sp-untied,nosp-untied,sp-tied,nosp-tied");
  const int steps = static_cast<int>(args.int_arg(3, 50));
  std::map<bool, Run> want;
  for (bool tied : {false, true}) want[tied] = reference(small_config(tied, tp), steps);
  for (const auto& kind : kinds)
    for (const auto& cfg : configs) {
      const bool sp = cfg.rfind("sp", 0) == 0, tied = cfg.find("-tied") != std::string::npos;
      Run got = on_mesh(kind, tp, sp, tied, steps);
      if (kind == "fsdp-bf16") {
        // bf16 compute against fp32: every step's loss within 5e-3 and gradient norm within
        // 10% (measured: 8e-4 and 3%), and further from fp32 than fp32 runs are from each
        // other (1e-5), or the bf16 parameters were not used. (Adam's normalised steps turn
        // the roundings into weight differences of a few percent: not compared.)
        double l32 = 0, n32 = 0;
        for (size_t i = 0; i < got.losses.size(); ++i) {
          l32 = std::max(l32, rel(got.losses[i], want[tied].losses[i]));
          n32 = std::max(n32, rel(got.norms[i], want[tied].norms[i]));
        }
        std::printf("%s tp %d %s: largest relative difference from fp32: loss %.3g, gradient norm %.3g\n",
                    kind.c_str(), tp, cfg.c_str(), l32, n32);
        WCHECK(l32 <= 5e-3 && n32 <= 0.1, kind, " ", cfg, ": loss off fp32 by ", l32, ", gradient norm by ", n32);
        WCHECK(l32 > 1e-5, kind, " ", cfg, ": the losses are fp32's (", l32, "): the bf16 parameters were not used");
        WCHECK(got.full.keys() == want[tied].full.keys(), kind, ": the state dict's keys differ from the plain model's");
      } else {
        expect_same(got, want[tied], concat(kind, " tp ", tp, " ", cfg), 1e-5);
      }
      std::printf("%s tp %d %s ok: final loss %.6f\n", kind.c_str(), tp, cfg.c_str(), got.losses.back());
    }
  {  // Where the groups' collectives run: TP inside a host over shared memory.
    parallel::DeviceMesh mesh(comm(), {{"dp", comm()->size() / tp}, {"tp", tp}});
    std::printf("tp group shared memory: %d, dp group shared memory: %d\n",
                mesh.comm("tp")->uses_shared_memory() ? 1 : 0, mesh.comm("dp")->uses_shared_memory() ? 1 : 0);
  }
  std::printf("tp parity ok rank %d\n", comm()->rank());
  std::fflush(stdout);
  return 0;
}

// tp_collectives: the tensor-parallel group's collectives for one block's forward and
// backward, without and with sequence parallelism (printed as "counts sp=N ar ag rs other
// bytes ar ag rs").
SCENARIO("tp_collectives") {
  auto world = comm();
  parallel::DeviceMesh mesh(world, {{"tp", world->size()}});
  for (bool sp : {false, true}) {
    gpt::Config c = small_config(false, world->size());
    c.tp = parallel::TensorParallel::from_mesh(mesh, "tp", sp);
    gpt::Block block(c);
    const int64_t t = sp ? c.seq_len / world->size() : c.seq_len;
    at::Tensor x = at::randn({2, t, c.d_model}).requires_grad_();
    const auto before = mesh.comm("tp")->counts();
    block->forward(x).sum().backward();
    const auto after = mesh.comm("tp")->counts();
    std::printf("counts sp=%d %lld %lld %lld %lld bytes %lld %lld %lld\n", sp ? 1 : 0,
                static_cast<long long>(after.all_reduce - before.all_reduce),
                static_cast<long long>(after.all_gather - before.all_gather),
                static_cast<long long>(after.reduce_scatter - before.reduce_scatter),
                static_cast<long long>(after.broadcast - before.broadcast + after.all_to_all - before.all_to_all),
                static_cast<long long>(after.all_reduce_bytes - before.all_reduce_bytes),
                static_cast<long long>(after.all_gather_bytes - before.all_gather_bytes),
                static_cast<long long>(after.reduce_scatter_bytes - before.reduce_scatter_bytes));
  }
  std::fflush(stdout);
  return 0;
}

// tp_plan: a Sequential MLP of torch::nn modules, cut by a plan by FQN over the world
// (Colwise, then Rowwise), computes what it computed whole: without sequence parallelism
// the whole output on every rank, with it this rank's sequence shard of it; the names are
// unchanged. Prints "plan ok rank R".
SCENARIO("tp_plan") {
  auto world = comm();
  for (bool sp : {false, true}) {
    at::manual_seed(5);
    torch::nn::Sequential mlp(torch::nn::Linear(8, 24),
                              torch::nn::Functional([](const at::Tensor& t) { return at::gelu(t); }),
                              torch::nn::Linear(24, 8));
    std::vector<std::string> names;
    for (auto& kv : mlp->named_parameters()) names.push_back(kv.key());
    at::Tensor x = at::randn({2, 4, 8});
    at::Tensor want = mlp->forward(x);
    parallel::TensorParallel tp{world, sp};
    const int replaced = parallel::parallelize(*mlp, {{"0", parallel::TpStyle::Colwise}, {"2", parallel::TpStyle::Rowwise}}, tp);
    WCHECK(replaced == 2, "replaced ", replaced);
    std::vector<std::string> after;
    for (auto& kv : mlp->named_parameters()) after.push_back(kv.key());
    WCHECK(after == names, "the plan changed the names");
    at::Tensor in = sp ? x.chunk(world->size(), 1)[world->rank()] : x;
    at::Tensor got = mlp->forward(in);
    at::Tensor expect = sp ? want.chunk(world->size(), 1)[world->rank()] : want;
    WCHECK(at::allclose(got, expect, 1e-5, 1e-6), "sp=", sp, ": the cut MLP's output differs by ",
           (got - expect).abs().max().item<double>());
  }
  std::printf("plan ok rank %d\n", world->rank());
  std::fflush(stdout);
  return 0;
}

// --- 2-D checkpoints -------------------------------------------------------------

namespace {

// A model on a (world/tp, tp) mesh under `kind` ("ddp" or "fsdp" over dp), built as
// on_mesh builds it, with its optimizer; trains steps [from, to) of the same global batches.
struct MeshRun {
  std::unique_ptr<parallel::DeviceMesh> mesh;
  gpt::Gpt model{nullptr};
  std::unique_ptr<strategy::Strategy> strat;
  torch::nn::AnyModule fwd;
  std::shared_ptr<torch::optim::AdamW> opt;
  int64_t seq_len = 0;

  MeshRun(const std::string& kind, int tp_size) {
    auto world = comm();
    mesh = std::make_unique<parallel::DeviceMesh>(world, std::vector<parallel::MeshDim>{{"dp", world->size() / tp_size},
                                                                                         {"tp", tp_size}});
    gpt::Config c = small_config(/*tied=*/false, tp_size);
    c.tp = parallel::TensorParallel::from_mesh(*mesh, "tp", true);
    seq_len = c.seq_len;
    strategy::StrategyOptions so;
    so.fsdp.auto_wrap = strategy::wrap_by_type<gpt::BlockImpl>();
    so.mesh_world = world;
    strat = strategy::make_strategy(kind, mesh->comm("dp"), c10::Device(c10::kCPU), so);
    at::manual_seed(11);
    model = gpt::Gpt(c);
    fwd = strat->setup(torch::nn::AnyModule(model));
    opt = std::make_shared<torch::optim::AdamW>(strat->module()->parameters(), torch::optim::AdamWOptions(kLr));
    strat->add_optimizer(opt);
  }
  std::vector<double> train(int from, int to) {
    const int dp_size = mesh->size("dp"), dp_rank = mesh->coordinate("dp");
    const int64_t per = kGlobalBatch / dp_size;
    std::vector<double> losses;
    for (int s = from; s < to; ++s) {
      auto [x, y] = batch(s, seq_len);
      at::Tensor loss = model->loss(fwd.forward(x.narrow(0, dp_rank * per, per)), y.narrow(0, dp_rank * per, per));
      strat->backward(loss);
      losses.push_back(mesh->comm("dp")->all_reduce_double(loss.item<double>()) / dp_size);
      strat->clip_grad_norm(kClip);
      strat->optimizer_step(*opt);
      opt->zero_grad();
    }
    return losses;
  }
  state::StateDict checkpoint_state(strategy::StateDictType type) {
    strategy::StrategyState st = strat->state(type);
    state::StateDict sd;
    sd.set("model", std::make_shared<state::StateDict>(st.module));
    sd.set("optim", std::make_shared<state::StateDict>(st.optimizers.at(0)));
    return sd;
  }
};

}  // namespace

// tp_resume DIR SRC DST [K M]: SRC and DST are KIND:TP (kind ddp or fsdp over the mesh's dp
// dimension, TP its tp size). Trains K steps on SRC's mesh, saves a sharded checkpoint of
// the model and AdamW state, trains M more; then builds DST's model, loads the checkpoint
// into its sharded state (each rank reading its pieces) and trains the same M steps. The
// losses agree bit for bit when the mesh and kind are the same, within 1e-5 otherwise.
SCENARIO("tp_resume") {
  const std::string dir = args.arg(0);
  auto parse = [](const std::string& s) {
    const auto colon = s.find(':');
    return std::make_pair(s.substr(0, colon), std::stoi(s.substr(colon + 1)));
  };
  const auto [src_kind, src_tp] = parse(args.arg(1));
  const auto [dst_kind, dst_tp] = parse(args.arg(2));
  const int K = static_cast<int>(args.int_arg(3, 4)), M = static_cast<int>(args.int_arg(4, 4));
  const std::string path = dir + "/ckpt";
  std::vector<double> want;
  {
    MeshRun a(src_kind, src_tp);
    a.train(0, K);
    checkpoint::SaveOptions so;
    so.mode = checkpoint::SaveMode::Sharded;
    checkpoint::save(a.checkpoint_state(strategy::StateDictType::Sharded), path, *comm(), so);
    want = a.train(K, K + M);
  }
  MeshRun b(dst_kind, dst_tp);
  state::materialize_optimizer_state(*b.opt, [&](torch::optim::Optimizer& o) { b.strat->optimizer_step(o); });
  // Into copies (as Fabric::load does), then applied through the strategy.
  std::function<state::StateDict(const state::StateDict&)> copy = [&](const state::StateDict& sd) {
    state::StateDict out;
    sd.for_each([&](const std::string& k, const state::Value& v) {
      if (const auto* t = std::get_if<at::Tensor>(&v)) out.set(k, t->detach().clone());
      else if (const auto* st = std::get_if<sharding::ShardedTensor>(&v)) out.set(k, st->clone());
      else if (const auto* d = std::get_if<std::shared_ptr<state::StateDict>>(&v)) out.set(k, std::make_shared<state::StateDict>(copy(**d)));
      else out.set(k, v);
    });
    return out;
  };
  state::StateDict target = copy(b.checkpoint_state(b.strat->default_state_dict_type()));
  checkpoint::LoadOptions lo;
  checkpoint::LoadResult res = checkpoint::load(target, path, *comm(), lo);
  WCHECK(res.missing.empty() && res.unexpected.empty(), "load: missing ", res.missing.size(), ", unexpected ",
         res.unexpected.size());
  strategy::StrategyState loaded;
  loaded.module = target.dict("model");
  loaded.optimizers[0] = target.dict("optim");
  b.strat->load_state(loaded);
  const std::vector<double> got = b.train(K, K + M);
  const bool same = src_kind == dst_kind && src_tp == dst_tp;
  for (int s = 0; s < M; ++s) {
    if (same)
      WCHECK(got[s] == want[s], "same mesh: step ", K + s, " loss ", got[s], " vs ", want[s], " (not bit-exact)");
    else
      WCHECK(rel(got[s], want[s]) <= 1e-5, args.arg(1), " -> ", args.arg(2), ": step ", K + s, " loss ", got[s], " vs ",
             want[s]);
  }
  std::printf("tp resume %s -> %s ok rank %d: losses %.8f .. %.8f\n", args.arg(1).c_str(), args.arg(2).c_str(),
              comm()->rank(), got.front(), got.back());
  std::fflush(stdout);
  return 0;
}
