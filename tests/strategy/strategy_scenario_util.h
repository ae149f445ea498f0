// The model, data and single-process reference shared by the strategy rank programs
// (strategy_parity_scenarios.cpp, strategy_state_scenarios.cpp), and the strategy each kind names.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "support/scenario.h"
#include "tessera/strategy/ddp.h"
#include "tessera/strategy/fsdp.h"

namespace tessera::testing::strategy_util {

using namespace tessera::strategy;

inline at::ScalarType g_seen_weight_dtype = at::kFloat;  // dtype of q.weight during the last forward
inline int64_t g_block_forwards = 0;                      // Block::forward calls (recomputation counts)

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
    ++g_block_forwards;
    at::Tensor h = ln(x);
    at::Tensor att = at::softmax(at::matmul(q(h), k(h).transpose(-2, -1)) / std::sqrt(7.0), -1);
    at::Tensor y = x + o(at::matmul(att, v(h)));
    return y + fc2(at::gelu(fc1(y)));
  }
};
TORCH_MODULE(Block);

inline torch::nn::Sequential make_model(uint64_t seed = 7) {
  at::manual_seed(seed);
  // Constructed in a fixed order (argument evaluation order is unspecified).
  torch::nn::Linear in(5, 7);
  Block b0, b1;
  torch::nn::Linear head(7, 3);
  return torch::nn::Sequential(in, b0, b1, head);
}

constexpr int64_t kBatch = 24, kSeq = 4;  // divisible by 1..4 ranks times 2 micro-batches

inline std::pair<at::Tensor, at::Tensor> global_batch(int step) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  at::Tensor x = at::randn({kBatch, kSeq, 5}, gen);
  at::Tensor y = at::randn({kBatch, kSeq, 3}, gen);
  return {x, y};
}

inline at::Tensor rows_of(const at::Tensor& t, int rank, int n) {
  const int64_t per = t.size(0) / n;
  return t.narrow(0, rank * per, per);
}

// A fixed evaluation batch: every rank runs the no-grad forward on all of it.
inline std::pair<at::Tensor, at::Tensor> eval_batch() { return global_batch(9999); }

inline double eval_loss(const std::function<at::Tensor(const at::Tensor&)>& forward) {
  at::NoGradGuard ng;
  auto [x, y] = eval_batch();
  return at::mse_loss(forward(x), y).item<double>();
}

inline double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-12); }
inline double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / std::max(b.norm().item<double>(), 1e-12);
}

struct Trace {
  std::vector<double> losses, norms;
  std::vector<double> evals;  // no-grad loss on the evaluation batch after each step
  std::map<std::string, at::Tensor> params;
};

// Single-process reference: plain libtorch on the whole global batch.
inline Trace reference(int steps, double clip, double lr, int micro = 1) {
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
    t.evals.push_back(eval_loss([&](const at::Tensor& x) { return model->forward(x); }));
  }
  for (auto& kv : model->named_parameters()) t.params[kv.key()] = kv.value().detach().clone();
  (void)micro;
  return t;
}

inline std::unique_ptr<Strategy> make_strategy(const std::string& kind, std::shared_ptr<distributed::Communicator> c) {
  if (kind == "ddp") return std::make_unique<DdpStrategy>(c);
  if (kind == "ddp_grad_copy") {
    DdpOptions o;
    o.gradient_as_bucket_view = false;
    return std::make_unique<DdpStrategy>(c, o);
  }
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
  } else if (kind == "hybrid_local") {  // one shard group per node (LOCAL_WORLD_SIZE)
    o.sharding = ShardingStrategy::HybridShard;
  } else if (kind == "bf16") {
    o.mixed_precision.param_dtype = at::kBFloat16;
  } else {
    throw Error("unknown strategy kind " + kind);
  }
  return std::make_unique<FsdpStrategy>(c, o);
}

inline void train_steps(Strategy& strat, torch::nn::AnyModule& m, torch::optim::Optimizer& opt, int from, int to,
                        std::vector<double>* losses, std::vector<double>* evals = nullptr) {
  auto c = strat.comm();
  for (int s = from; s < to; ++s) {
    auto [gx, gy] = global_batch(s);
    at::Tensor loss = at::mse_loss(m.forward(rows_of(gx, c->rank(), c->size())), rows_of(gy, c->rank(), c->size()));
    strat.backward(loss);
    if (losses) losses->push_back(c->all_reduce_double(loss.item<double>(), distributed::ReduceOp::Avg));
    strat.optimizer_step(opt);
    opt.zero_grad();
    if (evals) evals->push_back(eval_loss([&](const at::Tensor& x) { return m.forward(x); }));
  }
}

}  // namespace tessera::testing::strategy_util
