// A byte-level GPT written with libtorch modules: token + position embeddings, pre-norm
// transformer blocks (causal self-attention, GELU MLP) and a final LayerNorm + linear head
// over the 256 byte values. The blocks sit in a torch::nn::Sequential. Built through a
// strategy's module-init context (the `make_block` constructor argument) each block is
// an FSDP unit from the start; built plainly, a wrap policy (wrap_by_type<BlockImpl>)
// makes the same units at setup. The embeddings and the head belong to the root unit.
//
// Tensor parallelism (Config::tp, docs/tensor-parallel.md): the model is written with
// Tessera's tensor-parallel modules, which at a group of one compute exactly what
// torch::nn's do (the same kernels, the same initialization draws). Over a group of tp
// ranks each rank holds its heads' q, k and v rows of qkv (a cut in three stripes), its
// rows of fc and of the token embedding and head (vocabulary), and its columns of proj and
// fc_out; the norms, biases of the row-parallel layers and the position embedding are
// whole. With sequence parallelism the residual stream and the norms hold 1/tp of the
// sequence. Every parameter keeps its plain name and, in state dicts, its global shape;
// every weight is drawn whole from the global generator and cut, so a seed gives the same
// model at any tp. The logits are this rank's vocabulary columns: use loss().
//
// Tied head (`tie_weights`): the logits use the token embedding's weight directly, so the
// one tensor is registered once ("embed.tok.weight") and is used twice inside the root
// unit. FSDP (which refuses one tensor under two names) gathers it once per step and
// sees both gradient contributions summed before its gradient hook fires.
#pragma once
#include <ATen/ATen.h>
#include <torch/nn/init.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tessera/parallel/layers.h"

namespace gpt {

constexpr int64_t kVocab = 256;  // bytes

struct Config {
  int64_t n_layer = 4, n_head = 4, d_model = 128, seq_len = 64;
  bool tie_weights = false;
  // The tensor-parallel group and whether sequence parallelism is on (none: one rank).
  tessera::parallel::TensorParallel tp;
};

// N(0, std) drawn for a whole tensor of `shape` from the global generator (what
// weight.normal_ draws for a whole weight), for modules that keep a piece of it.
inline at::Tensor normal_whole(std::vector<int64_t> shape, double std) {
  at::NoGradGuard ng;
  return at::empty(shape).normal_(0.0, std);
}

// Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)).
struct BlockImpl : torch::nn::Module {
  int64_t n_head, d_model;
  tessera::parallel::TensorParallel tp;
  tessera::parallel::LayerNorm ln1{nullptr}, ln2{nullptr};
  tessera::parallel::ColumnParallelLinear qkv{nullptr}, fc{nullptr};
  tessera::parallel::RowParallelLinear proj{nullptr}, fc_out{nullptr};

  explicit BlockImpl(const Config& c) : n_head(c.n_head), d_model(c.d_model), tp(c.tp) {
    namespace par = tessera::parallel;
    const int64_t d = c.d_model;
    ln1 = register_module("ln1", par::LayerNorm(d, tp));
    qkv = register_module("qkv", par::ColumnParallelLinear(d, 3 * d, tp, true, /*stripes=*/3));
    proj = register_module("proj", par::RowParallelLinear(d, d, tp));
    ln2 = register_module("ln2", par::LayerNorm(d, tp));
    fc = register_module("fc", par::ColumnParallelLinear(d, 4 * d, tp));
    fc_out = register_module("fc_out", par::RowParallelLinear(4 * d, d, tp));
    // GPT-2 initialization, done here so that a block built as an FSDP unit (sharded the
    // moment it exists) starts from the same values as one built whole: N(0, 0.02)
    // weights, residual projections scaled by 1/sqrt(2 * n_layer), zero biases,
    // LayerNorms (1, 0). Each weight is drawn whole (in this order) and cut.
    const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
    qkv->assign(normal_whole({3 * d, d}, 0.02), at::zeros({3 * d}));
    proj->assign(normal_whole({d, d}, resid_std), at::zeros({d}));
    fc->assign(normal_whole({4 * d, d}, 0.02), at::zeros({4 * d}));
    fc_out->assign(normal_whole({d, 4 * d}, resid_std), at::zeros({d}));
  }

  // x: the residual stream ([B, T, D], or [B, T/tp, D] under sequence parallelism).
  at::Tensor attention(const at::Tensor& x) {
    at::Tensor h = qkv(x);  // [B, T, 3 D/tp]: this rank's heads' q, k, v
    const int64_t B = h.size(0), T = h.size(1), hd = d_model / n_head, heads = h.size(2) / (3 * hd);
    // [B, T, 3 D] -> three [B, H, T, hd]
    std::vector<at::Tensor> parts = h.view({B, T, 3, heads, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    at::Tensor att = at::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    at::Tensor future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(h.device())).triu(1);
    att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    at::Tensor y = at::matmul(att, parts[2]).transpose(1, 2).reshape({B, T, heads * hd});
    return proj(y);
  }

  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = x + attention(ln1(x));
    return h + fc_out(at::gelu(fc(ln2(h))));
  }
};
TORCH_MODULE(Block);

struct GptImpl : torch::nn::Module {
  Config cfg;
  tessera::parallel::VocabParallelEmbedding tok{nullptr};
  torch::nn::Embedding pos{nullptr};
  torch::nn::Sequential blocks;
  tessera::parallel::LayerNorm ln_f{nullptr};
  tessera::parallel::ColumnParallelLinear head{nullptr};  // null when tied

  // Builds each block through `make_block` when given one: pass a strategy's module-init
  // context (TrainingModule::init_module, Fabric::init_module) and under FSDP every block
  // is its own unit, sharded as soon as it is built, so no rank ever holds the whole
  // model. Initialization follows GPT-2 (see BlockImpl) and consumes the random stream
  // in construction order, so the weights for a seed do not depend on how blocks are built.
  using BlockBuilder = std::function<torch::nn::AnyModule(const std::function<torch::nn::AnyModule()>&)>;
  explicit GptImpl(const Config& c, const BlockBuilder& make_block = nullptr) : cfg(c) {
    namespace par = tessera::parallel;
    tok = register_module("tok", par::VocabParallelEmbedding(kVocab, c.d_model, c.tp));
    pos = register_module("pos", torch::nn::Embedding(c.seq_len, c.d_model));
    tok->assign(normal_whole({kVocab, c.d_model}, 0.02));
    {
      at::NoGradGuard ng;
      pos->weight.normal_(0.0, 0.02);
    }
    for (int64_t i = 0; i < c.n_layer; ++i) {
      auto build = [&c] { return torch::nn::AnyModule(Block(c)); };
      blocks->push_back(make_block ? make_block(build) : build());
    }
    register_module("blocks", blocks);
    ln_f = register_module("ln_f", par::LayerNorm(c.d_model, c.tp));
    if (!c.tie_weights) {
      head = register_module("head", par::ColumnParallelLinear(c.d_model, kVocab, c.tp, /*bias=*/false));
      head->assign(normal_whole({kVocab, c.d_model}, 0.02));
    }
  }

  // tokens [B, T] (int64, T <= seq_len) -> logits [B, T, 256], or this rank's vocabulary
  // columns [B, T, 256/tp] under tensor parallelism.
  at::Tensor forward(const at::Tensor& tokens) {
    namespace par = tessera::parallel;
    const auto& tp = cfg.tp;
    const int64_t T = tokens.size(1);
    const auto long_opts = at::TensorOptions().dtype(at::kLong).device(tokens.device());
    at::Tensor x;
    if (tp.sequence_parallel && tp.enabled()) {
      // Each rank holds T/tp positions of the residual stream: its rows of the position
      // embedding (a partial gradient, summed over the group).
      const int64_t t_local = T / tp.size();
      at::Tensor positions = at::arange(tp.rank() * t_local, (tp.rank() + 1) * t_local, long_opts);
      x = tok(tokens) + at::embedding(par::reduce_grad_over_tp(pos->weight, tp), positions);
    } else {
      x = tok(tokens) + pos(at::arange(T, long_opts));
    }
    x = ln_f(blocks->forward<at::Tensor>(x));
    return cfg.tie_weights ? at::linear(par::column_parallel_input(x, tp), tok->weight) : head(x);
  }

  // Mean cross-entropy of forward(tokens)'s logits against targets [B, T]: the whole
  // vocabulary's at a group of one, computed without gathering the logits over a larger one.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const {
    if (!cfg.tp.enabled())
      return at::cross_entropy_loss(logits.to(at::kFloat).reshape({-1, kVocab}), targets.reshape({-1}));
    return tessera::parallel::vocab_parallel_cross_entropy(logits, targets, tok->vocab_begin(), cfg.tp);
  }
};
TORCH_MODULE(Gpt);

// Parameters of the whole model (independent of how a strategy shards it).
inline int64_t count_parameters(const Config& c) {
  const int64_t d = c.d_model;
  const int64_t block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  return kVocab * d + c.seq_len * d + c.n_layer * block + 2 * d + (c.tie_weights ? 0 : d * kVocab);
}

}  // namespace gpt
