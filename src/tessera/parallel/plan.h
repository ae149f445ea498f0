// A tensor-parallel plan applied by FQN to a model built of standard torch::nn modules,
// PyTorch's parallelize_module for libtorch. libtorch modules have no forward hooks, so a
// plan cannot change how a torch::nn::Linear computes; what it can do is what FSDP's wrap
// policy does: replace a slot of a torch::nn::Sequential. Each named child (a Linear or an
// Embedding in a Sequential) is replaced by its tensor-parallel twin (layers.h) holding this
// rank's piece of the child's current weights, under the same FQNs:
//
//   torch::nn::Sequential mlp(torch::nn::Linear(d, 4 * d), torch::nn::GELU(), torch::nn::Linear(4 * d, d));
//   parallel::parallelize(*mlp, {{"0", parallel::TpStyle::Colwise}, {"2", parallel::TpStyle::Rowwise}}, tp);
//
// The Sequential then computes what it computed before, cut over the group (its input
// whole on every rank, or under sequence parallelism its sequence shard [B, T/tp, ...]).
// Modules that are not slots of a Sequential (a member registered by a custom module) are
// written with the tensor-parallel modules directly, as the GPT example is.
#pragma once
#include <torch/nn/module.h>

#include <map>
#include <string>

#include "tessera/parallel/tensor_parallel.h"

namespace tessera::parallel {

enum class TpStyle {
  Colwise,  // Linear -> ColumnParallelLinear; Embedding -> VocabParallelEmbedding (rows)
  Rowwise,  // Linear -> RowParallelLinear
};

// Replaces every child named in `plan` (an FQN below `root`, naming a torch::nn::Linear or,
// for Colwise, a torch::nn::Embedding that is an element of a torch::nn::Sequential).
// Collective-free. Throws tessera::Error naming the FQN when it names nothing, a module of
// another kind, or one that is not a Sequential's element; nothing is replaced then.
// Returns how many modules were replaced.
int parallelize(torch::nn::Module& root, const std::map<std::string, TpStyle>& plan, const TensorParallel& tp);

}  // namespace tessera::parallel
