// A byte-level GPT written with libtorch modules: token + position embeddings, pre-norm
// transformer blocks (causal self-attention, GELU MLP) and a final LayerNorm + linear head
// over the 256 byte values. The blocks sit in a torch::nn::Sequential. Built through a
// strategy's module-init context (the `make_block` constructor argument) each block is
// an FSDP unit from the start; built plainly, a wrap policy (wrap_by_type<BlockImpl>)
// makes the same units at setup. The embeddings and the head belong to the root unit.
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
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace gpt {

constexpr int64_t kVocab = 256;  // bytes

struct Config {
  int64_t n_layer = 4, n_head = 4, d_model = 128, seq_len = 64;
  bool tie_weights = false;
};

// Pre-norm block: x + attn(ln1(x)), then x + mlp(ln2(x)).
struct BlockImpl : torch::nn::Module {
  int64_t n_head, d_model;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_out{nullptr};

  explicit BlockImpl(const Config& c) : n_head(c.n_head), d_model(c.d_model) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    qkv = register_module("qkv", torch::nn::Linear(c.d_model, 3 * c.d_model));
    proj = register_module("proj", torch::nn::Linear(c.d_model, c.d_model));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    fc = register_module("fc", torch::nn::Linear(c.d_model, 4 * c.d_model));
    fc_out = register_module("fc_out", torch::nn::Linear(4 * c.d_model, c.d_model));
    // GPT-2 initialization, done here so that a block built as an FSDP unit (sharded the
    // moment it exists) starts from the same values as one built whole: N(0, 0.02)
    // weights, residual projections scaled by 1/sqrt(2 * n_layer), zero biases,
    // LayerNorms (1, 0).
    at::NoGradGuard ng;
    const double resid_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.n_layer));
    for (auto* l : {qkv.get(), proj.get(), fc.get(), fc_out.get()}) {
      l->weight.normal_(0.0, l == proj.get() || l == fc_out.get() ? resid_std : 0.02);
      l->bias.zero_();
    }
  }

  at::Tensor attention(const at::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), hd = d_model / n_head;
    // [B, T, 3D] -> three [B, H, T, hd]
    std::vector<at::Tensor> parts = qkv(x).view({B, T, 3, n_head, hd}).permute({2, 0, 3, 1, 4}).unbind(0);
    at::Tensor att = at::matmul(parts[0], parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    at::Tensor future = at::ones({T, T}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    att = at::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    at::Tensor y = at::matmul(att, parts[2]).transpose(1, 2).reshape({B, T, d_model});
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
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};  // null when tied

  // Builds each block through `make_block` when given one: pass a strategy's module-init
  // context (TrainingModule::init_module, Fabric::init_module) and under FSDP every block
  // is its own unit, sharded as soon as it is built, so no rank ever holds the whole
  // model. Initialization follows GPT-2 (see BlockImpl) and consumes the random stream
  // in construction order, so the weights for a seed do not depend on how blocks are built.
  using BlockBuilder = std::function<torch::nn::AnyModule(const std::function<torch::nn::AnyModule()>&)>;
  explicit GptImpl(const Config& c, const BlockBuilder& make_block = nullptr) : cfg(c) {
    tok = register_module("tok", torch::nn::Embedding(kVocab, c.d_model));
    pos = register_module("pos", torch::nn::Embedding(c.seq_len, c.d_model));
    {
      at::NoGradGuard ng;
      tok->weight.normal_(0.0, 0.02);
      pos->weight.normal_(0.0, 0.02);
    }
    for (int64_t i = 0; i < c.n_layer; ++i) {
      auto build = [&c] { return torch::nn::AnyModule(Block(c)); };
      blocks->push_back(make_block ? make_block(build) : build());
    }
    register_module("blocks", blocks);
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    if (!c.tie_weights) {
      head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.d_model, kVocab).bias(false)));
      at::NoGradGuard ng;
      head->weight.normal_(0.0, 0.02);
    }
  }

  // tokens [B, T] (int64, T <= seq_len) -> logits [B, T, 256]
  at::Tensor forward(const at::Tensor& tokens) {
    const int64_t T = tokens.size(1);
    at::Tensor x = tok(tokens) + pos(at::arange(T, at::TensorOptions().dtype(at::kLong).device(tokens.device())));
    x = ln_f(blocks->forward<at::Tensor>(x));
    return cfg.tie_weights ? at::linear(x, tok->weight) : head(x);
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
