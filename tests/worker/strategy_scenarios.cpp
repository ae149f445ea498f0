// Rank programs for the strategy tests: DDP and FSDP (every sharding strategy)
// trained on a small attention model with uneven parameter sizes, compared step by
// step with single-process training on the same global batch (computed in-process
// by every rank: the model is tiny).
#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "scenario.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

using namespace tessera;
using namespace tessera::testing;
using namespace tessera::strategy;

namespace {

at::ScalarType g_seen_weight_dtype = at::kFloat;  // dtype of q.weight during the last forward

// Pre-norm attention block, model dim 7, MLP dim 13.
struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, fc1{nullptr}, fc2{nullptr};
  BlockImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({7})));
    q = register_module("q", torch::nn::Linear(7, 7));
    // No key bias: its gradient is exactly zero (softmax is shift-invariant), and Adam
    // would turn rounding noise in it into full-size updates.
    k = register_module("k", torch::nn::Linear(torch::nn::LinearOptions(7, 7).bias(false)));
    v = register_module("v", torch::nn::Linear(7, 7));
    o = register_module("o", torch::nn::Linear(7, 7));
    fc1 = register_module("fc1", torch::nn::Linear(7, 13));
    fc2 = register_module("fc2", torch::nn::Linear(13, 7));
  }
  at::Tensor forward(const at::Tensor& x) {
    g_seen_weight_dtype = q->weight.scalar_type();
    at::Tensor h = ln(x);
    at::Tensor att = at::softmax(at::matmul(q(h), k(h).transpose(-2, -1)) / std::sqrt(7.0), -1);
    at::Tensor y = x + o(at::matmul(att, v(h)));
    return y + fc2(at::gelu(fc1(y)));
  }
};
TORCH_MODULE(Block);

torch::nn::Sequential make_model(uint64_t seed = 7) {
  at::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), Block(), Block(), torch::nn::Linear(7, 3));
}

constexpr int64_t kBatch = 24, kSeq = 4;  // divisible by 1..4 ranks times 2 micro-batches

std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  at::Tensor x = at::randn({kBatch, kSeq, 5}, gen);
  at::Tensor y = at::randn({kBatch, kSeq, 3}, gen);
  return {x, y};
}

at::Tensor rows_of(const at::Tensor& t, int rank, int n) {
  const int64_t per = t.size(0) / n;
  return t.narrow(0, rank * per, per);
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }
double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

struct Trace {
  std::vector<double> losses, norms;
  std::map<std::string, at::Tensor> params;
};

// Single-process reference: plain libtorch on the whole global batch.
Trace reference(int steps, double clip, double lr, int micro = 1) {
  auto model = make_model();
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(lr));
  Trace t;
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = global_batch(s);
    at::Tensor loss = at::mse_loss(model->forward(x), y);
    loss.backward();
    t.losses.push_back(loss.item<double>());
    if (clip > 0) t.norms.push_back(torch::nn::utils::clip_grad_norm_(model->parameters(), clip));
    opt.step();
    opt.zero_grad();
  }
  for (auto& kv : model->named_parameters()) t.params[kv.key()] = kv.value().detach().clone();
  (void)micro;
  return t;
}

std::unique_ptr<Strategy> make_strategy(const std::string& kind, std::shared_ptr<dist::Communicator> c) {
  if (kind == "ddp") return std::make_unique<DdpStrategy>(c);
  if (kind == "ddp_small_buckets") {
    DdpOptions o;
    o.bucket_cap_bytes = 600;  // several buckets
    return std::make_unique<DdpStrategy>(c, o);
  }
  FsdpOptions o;
  o.auto_wrap = wrap_by_type<BlockImpl>();
  if (kind == "full") o.sharding = ShardingStrategy::FullShard;
  else if (kind == "full_noprefetch") o.prefetch = false;
  else if (kind == "full_ckpt") o.activation_checkpointing = true;
  else if (kind == "full_offload") o.cpu_offload = true;
  else if (kind == "grad_op") o.sharding = ShardingStrategy::ShardGradOp;
  else if (kind == "no_shard") o.sharding = ShardingStrategy::NoShard;
  else if (kind == "hybrid") {
    o.sharding = ShardingStrategy::HybridShard;
    o.ranks_per_node = c->size() % 2 == 0 ? 2 : 1;
  } else if (kind == "bf16") {
    o.mixed_precision.param_dtype = at::kBFloat16;
  } else {
    throw Error("unknown strategy kind " + kind);
  }
  return std::make_unique<FsdpStrategy>(c, o);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

// Trains `kind` for `steps` on this rank's rows of each global batch.
Trace train(const std::string& kind, int steps, double clip, double lr, int micro = 1,
            Strategy** out_strategy = nullptr, std::unique_ptr<Strategy>* keep = nullptr) {
  auto c = comm();
  auto strat = make_strategy(kind, c);
  auto model = make_model();
  auto m = strat->setup(model);
  auto opt = std::make_shared<torch::optim::Adam>(strat->module()->parameters(), torch::optim::AdamOptions(lr));
  strat->add_optimizer(opt);
  Trace t;
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
    t.losses.push_back(c->all_reduce_double(loss_sum, dist::ReduceOp::Avg));
    if (clip > 0) t.norms.push_back(strat->clip_grad_norm(clip));
    strat->optimizer_step(*opt);
    opt->zero_grad();
  }
  auto sd = strat->state_dict(StateDictType::Full, false);
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
  const auto kinds = split_commas(args.arg(0, "ddp"));
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
