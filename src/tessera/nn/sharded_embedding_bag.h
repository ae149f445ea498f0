// A row-wise sharded embedding bag: the table [num_embeddings, dim] is a
// ShardedTensor chunked along rows over the ranks of a communicator (trailing ranks
// may own no rows). Each rank passes its own batch of bags and gets its own pooled
// embeddings back; rows owned elsewhere are looked up by their owner:
//
//   forward : all_gather(bags of every rank) -> each rank pools the rows it owns for
//             every bag (a partial sum) -> reduce_scatter: each rank receives the
//             sum of the partials of its own bags.
//   backward: all_gather(grad of every rank's pooled output) -> each rank
//             accumulates the gradient of the rows it owns (its local shard only).
//
// The local shard is the parameter "weight" (a sharded parameter: see
// state/module_state.h), so any optimizer updates local rows only and the module's
// state dict holds the whole table as a ShardedTensor. The table is created in
// configure_model() (see state::configure_model), once the communicator is known.
#pragma once
#include <torch/nn/module.h>

#include <memory>

#include "tessera/distributed/communicator.h"
#include "tessera/sharding/sharded_tensor.h"
#include "tessera/state/module_state.h"

namespace tessera::nn {

enum class BagMode { Sum, Mean };

struct ShardedEmbeddingBagOptions {
  int64_t num_embeddings = 0;
  int64_t embedding_dim = 0;
  BagMode mode = BagMode::Sum;
  // Initial values: ShardedTensor::rand with this seed (uniform [0, 1) times `init_scale`),
  // identical for every world size.
  uint64_t seed = 0;
  double init_scale = 1.0;
  at::ScalarType dtype = at::kFloat;
};

class ShardedEmbeddingBag : public torch::nn::Module, public state::ConfigurableModel {
 public:
  explicit ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options);

  // Creates the sharded table and registers its local shard as parameter "weight".
  void configure_model(const std::shared_ptr<distributed::Communicator>& comm) override;

  // `bags`: int64 [B, L], each row one bag of L row indices in [0, num_embeddings).
  // Returns [B, dim]. Collective: every rank calls it (B may differ, even be 0).
  at::Tensor forward(const at::Tensor& bags);

  // The whole table (a handle sharing the local shard with `weight`).
  sharding::ShardedTensor table() const;
  const ShardedEmbeddingBagOptions& options() const { return options_; }
  // First global row of this rank's shard and its row count.
  int64_t row_begin() const { return row_begin_; }
  int64_t row_count() const { return weight.defined() ? weight.size(0) : 0; }

  at::Tensor weight;  // this rank's rows (a parameter), defined after configure_model

 private:
  ShardedEmbeddingBagOptions options_;
  std::shared_ptr<distributed::Communicator> comm_;
  int64_t row_begin_ = 0;
};

}  // namespace tessera::nn
