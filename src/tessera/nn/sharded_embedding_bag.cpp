#include "tessera/nn/sharded_embedding_bag.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "tessera/core/error.h"

namespace tessera::nn {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Every rank's batch size, after checking every rank's indices: a bad index on one
// rank raises on all of them (naming the rank) instead of leaving peers hanging.
std::vector<int64_t> batch_sizes(distributed::Communicator& comm, const at::Tensor& bags, int64_t num_rows) {
  int64_t bad = -1, has_bad = 0;
  if (bags.numel() > 0) {
    const int64_t lo = bags.min().item<int64_t>(), hi = bags.max().item<int64_t>();
    if (lo < 0 || hi >= num_rows) {
      has_bad = 1;
      bad = lo < 0 ? lo : hi;
    }
  }
  at::Tensor t = at::tensor(std::vector<int64_t>{bags.size(0), has_bad, bad}, at::kLong).reshape({1, 3});
  at::Tensor all = comm.all_gather(t, std::vector<int64_t>(comm.size(), 1));
  std::vector<int64_t> sizes;
  for (int r = 0; r < comm.size(); ++r) {
    TESSERA_CHECK(all[r][1].item<int64_t>() == 0, "ShardedEmbeddingBag::forward: rank ", r, " passed index ",
                  all[r][2].item<int64_t>(), ", outside [0, ", num_rows, ")");
    sizes.push_back(all[r][0].item<int64_t>());
  }
  return sizes;
}

// The autograd function around the exchange. The communicator travels as an
// address in saved_data (the module that owns it outlives the graph).
struct ShardedLookup : public torch::autograd::Function<ShardedLookup> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor weight, at::Tensor bags, int64_t row_begin,
                            int64_t num_rows, distributed::Communicator* comm, bool mean) {
    const int64_t rows = weight.size(0), dim = weight.size(1), len = bags.size(1);
    std::vector<int64_t> sizes = batch_sizes(*comm, bags, num_rows);
    at::Tensor all_bags = comm->all_gather(bags.contiguous(), sizes);  // [B_total, L]
    const int64_t total = all_bags.size(0);
    at::Tensor flat = all_bags.reshape({-1});
    at::Tensor owned = (flat >= row_begin).logical_and(flat < row_begin + rows).nonzero().reshape({-1});
    at::Tensor local_rows = flat.index_select(0, owned) - row_begin;
    at::Tensor bag_of = owned.div(std::max<int64_t>(len, 1), "floor");  // integer division
    at::Tensor partial = at::zeros({total, dim}, weight.options());
    partial.index_add_(0, bag_of, weight.index_select(0, local_rows));
    if (mean && len > 0) partial.div_(static_cast<double>(len));
    at::Tensor out = comm->reduce_scatter(partial, sizes, distributed::ReduceOp::Sum);
    ctx->save_for_backward({local_rows, bag_of});
    ctx->saved_data["comm"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(comm));
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["rows"] = rows;
    ctx->saved_data["len"] = len;
    ctx->saved_data["mean"] = mean;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor local_rows = saved[0], bag_of = saved[1];
    auto* comm = reinterpret_cast<distributed::Communicator*>(static_cast<intptr_t>(ctx->saved_data["comm"].toInt()));
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const int64_t rows = ctx->saved_data["rows"].toInt(), len = ctx->saved_data["len"].toInt();
    TESSERA_CHECK(grads[0].defined(), "ShardedEmbeddingBag backward: undefined output gradient");
    at::Tensor all_g = comm->all_gather(grads[0].contiguous(), sizes);  // [B_total, D]
    at::Tensor gw = at::zeros({rows, all_g.size(1)}, all_g.options());
    gw.index_add_(0, local_rows, all_g.index_select(0, bag_of));
    if (ctx->saved_data["mean"].toBool() && len > 0) gw.div_(static_cast<double>(len));
    return {gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

ShardedEmbeddingBag::ShardedEmbeddingBag(const ShardedEmbeddingBagOptions& options) : options_(options) {
  TESSERA_CHECK(options.num_embeddings >= 0 && options.embedding_dim > 0, "ShardedEmbeddingBag: bad shape [",
                options.num_embeddings, ", ", options.embedding_dim, "]");
}

void ShardedEmbeddingBag::configure_model(const std::shared_ptr<distributed::Communicator>& comm) {
  TESSERA_CHECK(comm != nullptr, "ShardedEmbeddingBag::configure_model needs a communicator");
  comm_ = comm;
  auto spec = sharding::ChunkSpec::over_ranks(0, comm->size());
  auto table = sharding::ShardedTensor::rand(spec, {options_.num_embeddings, options_.embedding_dim}, options_.seed,
                                             at::TensorOptions().dtype(options_.dtype), comm);
  if (options_.init_scale != 1.0) table.apply_([&](at::Tensor& t) { t.mul_(options_.init_scale); });
  row_begin_ = table.local_shards()[0].meta.box.offsets[0];
  weight = state::register_sharded_parameter(*this, "weight", std::move(table));
}

sharding::ShardedTensor ShardedEmbeddingBag::table() const {
  auto t = state::find_sharded_tensor(*this, "weight");
  TESSERA_CHECK(t.has_value(), "ShardedEmbeddingBag: configure_model() has not been called");
  return *t;
}

at::Tensor ShardedEmbeddingBag::forward(const at::Tensor& bags) {
  TESSERA_CHECK(comm_ != nullptr && weight.defined(),
                "ShardedEmbeddingBag::forward before configure_model(): the table does not exist yet");
  TESSERA_CHECK(bags.dim() == 2 && bags.scalar_type() == at::kLong, "ShardedEmbeddingBag::forward: bags must be an "
                "int64 tensor [B, L], got ", bags.scalar_type(), " of ", bags.dim(), " dimensions");
  return ShardedLookup::apply(weight, bags.to(weight.device()), row_begin_, options_.num_embeddings, comm_.get(),
                              options_.mode == BagMode::Mean);
}

}  // namespace tessera::nn
