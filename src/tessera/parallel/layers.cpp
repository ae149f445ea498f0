#include "tessera/parallel/layers.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/init.h>

#include <cmath>

#include "tessera/core/error.h"

namespace tessera::parallel {

namespace {

TpCut make_cut(int64_t dim, int64_t stripes, std::vector<int64_t> shape, const TensorParallel& tp,
               const std::string& what) {
  TpCut cut;
  cut.dim = dim;
  cut.stripes = stripes;
  cut.global_shape = std::move(shape);
  cut.pieces = tp.size();
  cut.index = tp.rank();
  cut.validate(what);
  return cut;
}

// torch::nn::Linear's initialization of a whole [out, in] weight and [out] bias, drawing
// from the global generator exactly as LinearImpl::reset_parameters does (draw = false:
// zeros, and nothing drawn).
std::pair<at::Tensor, at::Tensor> linear_init(int64_t in, int64_t out, bool bias, bool draw) {
  at::NoGradGuard ng;
  if (!draw) return {at::zeros({out, in}), bias ? at::zeros({out}) : at::Tensor()};
  at::Tensor w = at::empty({out, in});
  torch::nn::init::kaiming_uniform_(w, std::sqrt(5.0));
  at::Tensor b;
  if (bias) {
    b = at::empty({out});
    const double bound = in > 0 ? 1.0 / std::sqrt(static_cast<double>(in)) : 0.0;
    torch::nn::init::uniform_(b, -bound, bound);
  }
  return {w, b};
}

void copy_piece(at::Tensor& param, const at::Tensor& piece, const char* what) {
  TESSERA_CHECK(param.sizes() == piece.sizes(), what, ": piece of shape ", piece.sizes(), " for a parameter of shape ",
                param.sizes());
  at::NoGradGuard ng;
  param.copy_(piece);
}

}  // namespace

at::Tensor column_parallel_input(const at::Tensor& x, const TensorParallel& tp, int64_t seq_dim) {
  return tp.sequence_parallel ? gather_sequence(x, seq_dim, tp) : copy_to_tp(x, tp);
}

// --- ColumnParallelLinear ------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, TensorParallel tp, bool with_bias,
                                                   int64_t stripes, int64_t seq_dim, bool draw)
    : tp_(std::move(tp)), seq_dim_(seq_dim) {
  const std::string what = concat("ColumnParallelLinear(", in, ", ", out, ")");
  weight_cut_ = make_cut(0, stripes, {out, in}, tp_, what);
  bias_cut_ = make_cut(0, stripes, {out}, tp_, what);
  auto [w, b] = linear_init(in, out, with_bias, draw);
  weight = register_parameter("weight", weight_cut_.local_of(w));
  if (with_bias) bias = register_parameter("bias", bias_cut_.local_of(b));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return forward_local(column_parallel_input(x, tp_, seq_dim_));
}

at::Tensor ColumnParallelLinearImpl::forward_local(const at::Tensor& x_full) { return at::linear(x_full, weight, bias); }

void ColumnParallelLinearImpl::assign(const at::Tensor& global_weight, const at::Tensor& global_bias) {
  copy_piece(weight, weight_cut_.local_of(global_weight), "ColumnParallelLinear::assign (weight)");
  if (global_bias.defined()) copy_piece(bias, bias_cut_.local_of(global_bias), "ColumnParallelLinear::assign (bias)");
}

std::vector<std::pair<std::string, TpCut>> ColumnParallelLinearImpl::tp_cuts() const {
  std::vector<std::pair<std::string, TpCut>> out{{"weight", weight_cut_}};
  if (bias.defined()) out.emplace_back("bias", bias_cut_);
  return out;
}

// --- RowParallelLinear -----------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, TensorParallel tp, bool with_bias,
                                             int64_t seq_dim, bool draw)
    : tp_(std::move(tp)), seq_dim_(seq_dim) {
  weight_cut_ = make_cut(1, 1, {out, in}, tp_, concat("RowParallelLinear(", in, ", ", out, ")"));
  auto [w, b] = linear_init(in, out, with_bias, draw);
  weight = register_parameter("weight", weight_cut_.local_of(w));
  if (with_bias) bias = register_parameter("bias", b);
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  at::Tensor partial = at::linear(x, weight);
  at::Tensor y = tp_.sequence_parallel ? reduce_scatter_sequence(partial, seq_dim_, tp_) : reduce_from_tp(partial, tp_);
  if (!bias.defined()) return y;
  return y + (tp_.sequence_parallel ? reduce_grad_over_tp(bias, tp_) : bias);
}

void RowParallelLinearImpl::assign(const at::Tensor& global_weight, const at::Tensor& global_bias) {
  copy_piece(weight, weight_cut_.local_of(global_weight), "RowParallelLinear::assign (weight)");
  if (global_bias.defined()) copy_piece(bias, global_bias, "RowParallelLinear::assign (bias)");
}

std::vector<std::pair<std::string, TpCut>> RowParallelLinearImpl::tp_cuts() const { return {{"weight", weight_cut_}}; }

// --- VocabParallelEmbedding -----------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t num, int64_t dim, TensorParallel tp, int64_t seq_dim,
                                                       bool draw)
    : tp_(std::move(tp)), seq_dim_(seq_dim) {
  weight_cut_ = make_cut(0, 1, {num, dim}, tp_, concat("VocabParallelEmbedding(", num, ", ", dim, ")"));
  at::Tensor w;
  {
    at::NoGradGuard ng;
    w = at::zeros({num, dim});
    if (draw) torch::nn::init::normal_(w);  // torch::nn::Embedding's initialization
  }
  weight = register_parameter("weight", weight_cut_.local_of(w));
}

at::Tensor VocabParallelEmbeddingImpl::forward(const at::Tensor& tokens) {
  if (!tp_.enabled()) return at::embedding(weight, tokens);
  const int64_t begin = vocab_begin(), n = vocab_size_local();
  at::Tensor outside = tokens.lt(begin).logical_or(tokens.ge(begin + n));
  at::Tensor e;
  if (n > 0) {
    e = at::embedding(weight, (tokens - begin).masked_fill(outside, 0));
    e = e.masked_fill(outside.unsqueeze(-1), 0.0);
  } else {  // this rank holds no rows: contributes zeros (and an empty gradient)
    std::vector<int64_t> shape = tokens.sizes().vec();
    shape.push_back(weight.size(1));
    e = at::zeros(shape, weight.options()) + weight.sum() * 0;
  }
  return tp_.sequence_parallel ? reduce_scatter_sequence(e, seq_dim_, tp_) : reduce_from_tp(e, tp_);
}

void VocabParallelEmbeddingImpl::assign(const at::Tensor& global_weight) {
  copy_piece(weight, weight_cut_.local_of(global_weight), "VocabParallelEmbedding::assign");
}

std::vector<std::pair<std::string, TpCut>> VocabParallelEmbeddingImpl::tp_cuts() const {
  return {{"weight", weight_cut_}};
}

// --- LayerNorm ------------------------------------------------------------------------

LayerNormImpl::LayerNormImpl(int64_t features, TensorParallel tp, double eps)
    : tp_(std::move(tp)), features_(features), eps_(eps) {
  weight = register_parameter("weight", at::ones({features}));
  bias = register_parameter("bias", at::zeros({features}));
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  const bool sp = tp_.sequence_parallel;
  return at::layer_norm(x, {features_}, sp ? reduce_grad_over_tp(weight, tp_) : weight,
                        sp ? reduce_grad_over_tp(bias, tp_) : bias, eps_);
}

// --- vocab-parallel cross-entropy ------------------------------------------------------

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                            int64_t vocab_begin, int64_t comm_address) {
    auto* comm = reinterpret_cast<distributed::Communicator*>(static_cast<intptr_t>(comm_address));
    const int64_t v = logits.size(-1);
    at::Tensor l = logits.reshape({-1, v}).to(at::kFloat);
    at::Tensor t = targets.reshape({-1}).to(at::kLong);
    TESSERA_CHECK(l.size(0) == t.size(0), "vocab_parallel_cross_entropy: ", l.size(0), " rows of logits for ",
                  t.size(0), " targets");
    const int64_t n = l.size(0);
    at::Tensor m = v > 0 ? std::get<0>(l.max(1)) : at::full({n}, -std::numeric_limits<float>::infinity(), l.options());
    if (comm) comm->all_reduce(m, distributed::ReduceOp::Max);
    at::Tensor shifted = l - m.unsqueeze(1);
    at::Tensor e = shifted.exp();
    at::Tensor mine = t.ge(vocab_begin).logical_and(t.lt(vocab_begin + v));
    at::Tensor idx = (t - vocab_begin).clamp(0, std::max<int64_t>(v - 1, 0));
    at::Tensor target_logit = v > 0 ? shifted.gather(1, idx.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0.0)
                                    : at::zeros({n}, l.options());
    at::Tensor sums = at::stack({e.sum(1), target_logit});  // [2, N]
    if (comm) comm->all_reduce(sums);
    at::Tensor loss = (sums[0].log() - sums[1]).mean();
    ctx->save_for_backward({e.div_(sums[0].unsqueeze(1)), idx, mine});
    ctx->saved_data["shape"] = logits.sizes().vec();
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor grad = saved[0].clone();  // softmax over the whole vocabulary, this rank's columns
    const int64_t n = grad.size(0);
    if (grad.size(1) > 0) grad.scatter_add_(1, saved[1].unsqueeze(1), saved[2].to(grad.scalar_type()).neg().unsqueeze(1));
    grad.mul_(grads[0] / static_cast<double>(std::max<int64_t>(n, 1)));
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {grad.view(ctx->saved_data["shape"].toIntVector()).to(dtype), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_begin,
                                        const TensorParallel& tp) {
  distributed::Communicator* comm = tp.enabled() ? tp.comm.get() : nullptr;
  return VocabParallelCrossEntropy::apply(logits, targets, vocab_begin,
                                          static_cast<int64_t>(reinterpret_cast<intptr_t>(comm)));
}

}  // namespace tessera::parallel
