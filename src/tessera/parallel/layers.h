// Tensor-parallel building blocks for libtorch models (docs/tensor-parallel.md). Each
// module keeps the parameter names of the torch::nn module it replaces ("weight",
// "bias") and holds this rank's piece of each cut parameter, so a model written with
// them has the plain model's FQNs, and its state dicts (through a strategy) the plain
// model's global tensors. Each initializes exactly as its torch::nn twin does, drawing
// the whole tensor from the global generator and keeping its piece: the same seed gives
// the same global weights at any tensor-parallel size.
//
//  - ColumnParallelLinear: out_features cut (weight rows, bias); the input is the full
//    activation (copy_to_tp), or with sequence parallelism the sequence shard, gathered
//    (gather_sequence); the output is this rank's features. `stripes` cuts a fused weight
//    by meaning: qkv [3d, d] with stripes 3 gives each rank its heads' q, k and v rows.
//  - RowParallelLinear: in_features cut (weight columns); the input is this rank's
//    features; the partial products are summed (reduce_from_tp), or with sequence
//    parallelism reduce-scattered along the sequence; the bias is whole and added after.
//  - VocabParallelEmbedding: rows cut by torch.chunk's rule; each rank looks up the
//    tokens it owns and the partial embeddings are summed (or reduce-scattered).
//  - LayerNorm: whole (replicated) parameters; under sequence parallelism each rank
//    normalizes its sequence shard and the parameters' gradients are summed over the group.
//  - vocab_parallel_cross_entropy: the loss of vocabulary-cut logits, without gathering
//    them: two all-reduces of [N] values (the max, then the sum of exponentials with the
//    target's logit).
//
// Activations are [batch, sequence, features] with the sequence at `seq_dim` (1).
#pragma once
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "tessera/parallel/tensor_parallel.h"

namespace tessera::parallel {

// The input side of a column-parallel product: gather_sequence under sequence
// parallelism, else copy_to_tp. For heads that use another module's weight (a tied head).
at::Tensor column_parallel_input(const at::Tensor& x, const TensorParallel& tp, int64_t seq_dim = 1);

class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  // draw = false: no initial values are drawn (assign() gives them; parallelize does).
  ColumnParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallel tp, bool bias = true,
                           int64_t stripes = 1, int64_t seq_dim = 1, bool draw = true);
  at::Tensor forward(const at::Tensor& x);
  // The product of an input already laid out for it (column_parallel_input).
  at::Tensor forward_local(const at::Tensor& x_full);
  // Replaces the parameters with this rank's pieces of global values (bias may be undefined).
  void assign(const at::Tensor& global_weight, const at::Tensor& global_bias = at::Tensor());
  std::vector<std::pair<std::string, TpCut>> tp_cuts() const override;
  const TensorParallel& tensor_parallel() const override { return tp_; }
  const TpCut& weight_cut() const { return weight_cut_; }

  at::Tensor weight, bias;

 private:
  TensorParallel tp_;
  TpCut weight_cut_, bias_cut_;
  int64_t seq_dim_;
};
TORCH_MODULE(ColumnParallelLinear);

class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  RowParallelLinearImpl(int64_t in_features, int64_t out_features, TensorParallel tp, bool bias = true,
                        int64_t seq_dim = 1, bool draw = true);
  at::Tensor forward(const at::Tensor& x);
  void assign(const at::Tensor& global_weight, const at::Tensor& global_bias = at::Tensor());
  std::vector<std::pair<std::string, TpCut>> tp_cuts() const override;
  const TensorParallel& tensor_parallel() const override { return tp_; }
  const TpCut& weight_cut() const { return weight_cut_; }

  at::Tensor weight, bias;  // bias whole

 private:
  TensorParallel tp_;
  TpCut weight_cut_;
  int64_t seq_dim_;
};
TORCH_MODULE(RowParallelLinear);

class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelModule {
 public:
  VocabParallelEmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim, TensorParallel tp, int64_t seq_dim = 1,
                             bool draw = true);
  // tokens [B, T] -> [B, T, dim], or [B, T/tp, dim] under sequence parallelism.
  at::Tensor forward(const at::Tensor& tokens);
  void assign(const at::Tensor& global_weight);
  std::vector<std::pair<std::string, TpCut>> tp_cuts() const override;
  const TensorParallel& tensor_parallel() const override { return tp_; }
  // The first vocabulary row this rank holds, and how many.
  int64_t vocab_begin() const { return weight_cut_.ranges(weight_cut_.index)[0].begin; }
  int64_t vocab_size_local() const { return weight_cut_.ranges(weight_cut_.index)[0].size; }

  at::Tensor weight;

 private:
  TensorParallel tp_;
  TpCut weight_cut_;
  int64_t seq_dim_;
};
TORCH_MODULE(VocabParallelEmbedding);

class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t features, TensorParallel tp, double eps = 1e-5);
  at::Tensor forward(const at::Tensor& x);

  at::Tensor weight, bias;

 private:
  TensorParallel tp_;
  int64_t features_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

// Mean cross-entropy over every row of `logits` [..., V_local] (this rank's vocabulary
// rows [vocab_begin, vocab_begin + V_local) of the logits) against `targets` [...] (global
// token ids), identical on every rank of the group; the gradient flows to the local logits
// only. With a group of one it is at::cross_entropy's value.
at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocab_begin,
                                        const TensorParallel& tp);

}  // namespace tessera::parallel
