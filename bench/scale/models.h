// Parameter shapes of the models the scale harness plans checkpoints for (no data: names
// and shapes only), grouped into FSDP units as Tessera's FSDP groups them: one unit per
// transformer block and a root unit holding everything else (embeddings, final norm,
// head), each unit's parameters laid end to end in named_parameters() order
// (strategy/fsdp_param_group.cpp: flat_offset). Each parameter also carries its tensor-
// parallel cut (the dimension a TP plan cuts, and its stripes; none for the parameters TP
// keeps whole), so that the 2-D cases can lay the units out at TP-local sizes (tp_local).
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
  int tp_dim = -1;          // the dimension tensor parallelism cuts (-1: kept whole)
  int64_t tp_stripes = 1;   // equal stripes of that dimension each cut alike (a fused qkv: 3)
  bool tp_cut() const { return tp_dim >= 0; }
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

// Appends `fqn` to unit `u`, at the unit's current end, cut by tensor parallelism along
// `tp_dim` in `stripes` stripes (-1: kept whole).
inline void add(Model& m, int u, std::string fqn, std::vector<int64_t> shape, int tp_dim = -1, int64_t stripes = 1) {
  if (static_cast<int>(m.unit_numel.size()) <= u) m.unit_numel.resize(static_cast<size_t>(u) + 1, 0);
  Param p{std::move(fqn), std::move(shape), u, m.unit_numel[static_cast<size_t>(u)], tp_dim, stripes};
  m.unit_numel[static_cast<size_t>(u)] += p.numel();
  m.params.push_back(std::move(p));
}

}  // namespace detail

// examples/gpt/model.h's GPT (the names its Trainer saves), at any size: tok, pos, blocks,
// ln_f, head (absent when tied). Unit 0 is the root (tok, pos, ln_f, head), unit 1 + i
// block i. Its tensor-parallel plan (examples/gpt/model.h): vocabulary-parallel tok and
// head (dim 0), qkv column-parallel in 3 stripes (q, k, v), fc column-parallel (dim 0,
// weight and bias), proj and fc_out row-parallel (dim 1, their biases whole), the norms and
// pos whole.
inline Model gpt(const std::string& name, int64_t vocab, int64_t n_layer, int64_t d, int64_t seq_len, bool tied) {
  using detail::add;
  Model m;
  m.name = name;
  m.unit_numel.assign(static_cast<size_t>(n_layer) + 1, 0);
  add(m, 0, "tok.weight", {vocab, d}, 0);
  add(m, 0, "pos.weight", {seq_len, d});
  for (int64_t i = 0; i < n_layer; ++i) {
    const int u = static_cast<int>(i) + 1;
    const std::string b = "blocks." + std::to_string(i) + ".";
    add(m, u, b + "ln1.weight", {d});
    add(m, u, b + "ln1.bias", {d});
    add(m, u, b + "qkv.weight", {3 * d, d}, 0, 3);
    add(m, u, b + "qkv.bias", {3 * d}, 0, 3);
    add(m, u, b + "proj.weight", {d, d}, 1);
    add(m, u, b + "proj.bias", {d});
    add(m, u, b + "ln2.weight", {d});
    add(m, u, b + "ln2.bias", {d});
    add(m, u, b + "fc.weight", {4 * d, d}, 0);
    add(m, u, b + "fc.bias", {4 * d}, 0);
    add(m, u, b + "fc_out.weight", {d, 4 * d}, 1);
    add(m, u, b + "fc_out.bias", {d});
  }
  add(m, 0, "ln_f.weight", {d});
  add(m, 0, "ln_f.bias", {d});
  if (!tied) add(m, 0, "head.weight", {vocab, d}, 0);
  return m;
}

// Llama 3 with Hugging Face's parameter names (without the "model." of LlamaForCausalLM:
// Tessera's Trainer adds its own "model." prefix): embed_tokens, layers.i.{self_attn,
// mlp, norms}, norm, lm_head (untied). Unit 0 is the root (embed_tokens, norm, lm_head).
// Its tensor-parallel plan is torchtitan's: q, k, v, gate and up column-wise (dim 0, one
// stripe each: Hugging Face keeps them apart), o and down row-wise (dim 1), embed_tokens
// vocabulary-parallel (dim 0), lm_head column-wise (dim 0), the norms whole.
inline Model llama(const std::string& name, int64_t n_layer, int64_t d, int64_t heads, int64_t kv_heads, int64_t ffn,
                   int64_t vocab) {
  using detail::add;
  Model m;
  m.name = name;
  const int64_t hd = d / heads, kv = kv_heads * hd;
  m.unit_numel.assign(static_cast<size_t>(n_layer) + 1, 0);
  add(m, 0, "embed_tokens.weight", {vocab, d}, 0);
  for (int64_t i = 0; i < n_layer; ++i) {
    const int u = static_cast<int>(i) + 1;
    const std::string b = "layers." + std::to_string(i) + ".";
    add(m, u, b + "self_attn.q_proj.weight", {d, d}, 0);
    add(m, u, b + "self_attn.k_proj.weight", {kv, d}, 0);
    add(m, u, b + "self_attn.v_proj.weight", {kv, d}, 0);
    add(m, u, b + "self_attn.o_proj.weight", {d, d}, 1);
    add(m, u, b + "mlp.gate_proj.weight", {ffn, d}, 0);
    add(m, u, b + "mlp.up_proj.weight", {ffn, d}, 0);
    add(m, u, b + "mlp.down_proj.weight", {d, ffn}, 1);
    add(m, u, b + "input_layernorm.weight", {d});
    add(m, u, b + "post_attention_layernorm.weight", {d});
  }
  add(m, 0, "norm.weight", {d});
  add(m, 0, "lm_head.weight", {vocab, d}, 0);
  return m;
}

// A model's FSDP units at the TP-local sizes of a tp-way tensor-parallel plan: the flat
// vector FSDP cuts over the data-parallel ranks holds each rank's TP pieces (a cut
// parameter's dimension divided by tp; tp must divide it, stripe by stripe: uneven pieces
// are refused by a sharded 2-D save, strategy/tp_state.cpp) and the whole parameters, in
// the same order. unit_numel per unit, offset per parameter (Model::params' order).
struct TpLocal {
  std::vector<int64_t> unit_numel, offset;
};

inline std::vector<int64_t> tp_local_shape(const Param& p, int64_t tp) {
  std::vector<int64_t> s = p.shape;
  if (p.tp_cut()) {
    const size_t d = static_cast<size_t>(p.tp_dim);
    if (s[d] % (p.tp_stripes * tp) != 0)
      throw std::runtime_error(p.fqn + ": dimension " + std::to_string(p.tp_dim) + " (" + std::to_string(s[d]) +
                               ") does not split evenly into " + std::to_string(p.tp_stripes) + " stripes x tp " +
                               std::to_string(tp));
    s[d] /= tp;
  }
  return s;
}

inline TpLocal tp_local(const Model& m, int64_t tp) {
  TpLocal out;
  out.unit_numel.assign(m.unit_numel.size(), 0);
  for (const auto& p : m.params) {
    int64_t n = 1;
    for (auto d : tp_local_shape(p, tp)) n *= d;
    out.offset.push_back(out.unit_numel[static_cast<size_t>(p.unit)]);
    out.unit_numel[static_cast<size_t>(p.unit)] += n;
  }
  return out;
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
