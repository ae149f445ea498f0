// Parameter shapes of the models the scale harness plans checkpoints for (no data: names
// and shapes only), grouped into FSDP units as Tessera's FSDP groups them: one unit per
// transformer block and a root unit holding everything else (embeddings, final norm,
// head), each unit's parameters laid end to end in named_parameters() order
// (strategy/fsdp_param_group.cpp: flat_offset).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace scale {

struct Param {
  std::string fqn;
  std::vector<int64_t> shape;
  int unit = 0;             // index into Model::unit_numel
  int64_t offset = 0;       // flat offset inside its unit
  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

struct Model {
  std::string name, note;
  std::vector<Param> params;        // named_parameters() order
  std::vector<int64_t> unit_numel;  // T of each unit (0 = root)
  int64_t numel() const {
    int64_t n = 0;
    for (const auto& p : params) n += p.numel();
    return n;
  }
};

namespace detail {

// Appends `fqn` to unit `u`, at the unit's current end.
inline void add(Model& m, int u, std::string fqn, std::vector<int64_t> shape) {
  if (static_cast<int>(m.unit_numel.size()) <= u) m.unit_numel.resize(static_cast<size_t>(u) + 1, 0);
  Param p{std::move(fqn), std::move(shape), u, m.unit_numel[static_cast<size_t>(u)]};
  m.unit_numel[static_cast<size_t>(u)] += p.numel();
  m.params.push_back(std::move(p));
}

}  // namespace detail

// examples/gpt/model.h's GPT (the names its Trainer saves), at any size: tok, pos, blocks,
// ln_f, head (absent when tied). Unit 0 is the root (tok, pos, ln_f, head), unit 1 + i
// block i.
inline Model gpt(const std::string& name, int64_t vocab, int64_t n_layer, int64_t d, int64_t seq_len, bool tied) {
  using detail::add;
  Model m;
  m.name = name;
  m.unit_numel.assign(static_cast<size_t>(n_layer) + 1, 0);
  add(m, 0, "tok.weight", {vocab, d});
  add(m, 0, "pos.weight", {seq_len, d});
  for (int64_t i = 0; i < n_layer; ++i) {
    const int u = static_cast<int>(i) + 1;
    const std::string b = "blocks." + std::to_string(i) + ".";
    add(m, u, b + "ln1.weight", {d});
    add(m, u, b + "ln1.bias", {d});
    add(m, u, b + "qkv.weight", {3 * d, d});
    add(m, u, b + "qkv.bias", {3 * d});
    add(m, u, b + "proj.weight", {d, d});
    add(m, u, b + "proj.bias", {d});
    add(m, u, b + "ln2.weight", {d});
    add(m, u, b + "ln2.bias", {d});
    add(m, u, b + "fc.weight", {4 * d, d});
    add(m, u, b + "fc.bias", {4 * d});
    add(m, u, b + "fc_out.weight", {d, 4 * d});
    add(m, u, b + "fc_out.bias", {d});
  }
  add(m, 0, "ln_f.weight", {d});
  add(m, 0, "ln_f.bias", {d});
  if (!tied) add(m, 0, "head.weight", {vocab, d});
  return m;
}

// Llama 3 with Hugging Face's parameter names (without the "model." of LlamaForCausalLM:
// Tessera's Trainer adds its own "model." prefix): embed_tokens, layers.i.{self_attn,
// mlp, norms}, norm, lm_head (untied). Unit 0 is the root (embed_tokens, norm, lm_head).
inline Model llama(const std::string& name, int64_t n_layer, int64_t d, int64_t heads, int64_t kv_heads, int64_t ffn,
                   int64_t vocab) {
  using detail::add;
  Model m;
  m.name = name;
  const int64_t hd = d / heads, kv = kv_heads * hd;
  m.unit_numel.assign(static_cast<size_t>(n_layer) + 1, 0);
  add(m, 0, "embed_tokens.weight", {vocab, d});
  for (int64_t i = 0; i < n_layer; ++i) {
    const int u = static_cast<int>(i) + 1;
    const std::string b = "layers." + std::to_string(i) + ".";
    add(m, u, b + "self_attn.q_proj.weight", {d, d});
    add(m, u, b + "self_attn.k_proj.weight", {kv, d});
    add(m, u, b + "self_attn.v_proj.weight", {kv, d});
    add(m, u, b + "self_attn.o_proj.weight", {d, d});
    add(m, u, b + "mlp.gate_proj.weight", {ffn, d});
    add(m, u, b + "mlp.up_proj.weight", {ffn, d});
    add(m, u, b + "mlp.down_proj.weight", {d, ffn});
    add(m, u, b + "input_layernorm.weight", {d});
    add(m, u, b + "post_attention_layernorm.weight", {d});
  }
  add(m, 0, "norm.weight", {d});
  add(m, 0, "lm_head.weight", {vocab, d});
  return m;
}

inline Model model_by_name(const std::string& name) {
  if (name == "gpt2-124m") {
    Model m = gpt(name, 50257, 12, 768, 1024, /*tied=*/true);
    m.note = "GPT-2 small: 12 layers, d 768, vocab 50257, context 1024, head tied to tok.weight (124.4M parameters)";
    return m;
  }
  if (name == "llama3-8b") {
    Model m = llama(name, 32, 4096, 32, 8, 14336, 128256);
    m.note = "Llama-3-8B: 32 layers, d 4096, 32 heads / 8 KV heads, FFN 14336, vocab 128256, lm_head untied";
    return m;
  }
  if (name == "llama3-70b") {
    Model m = llama(name, 80, 8192, 64, 8, 28672, 128256);
    m.note = "Llama-3-70B: 80 layers, d 8192, 64 heads / 8 KV heads, FFN 28672, vocab 128256, lm_head untied";
    return m;
  }
  throw std::runtime_error("unknown model '" + name + "' (gpt2-124m, llama3-8b, llama3-70b; tiny-gpt with --predict)");
}

}  // namespace scale
