// Trains a model whose embedding table is sharded row-wise across the ranks:
//
//   tessera run -n 3 -- build/bin/sharded_embedding [steps]
//
// Each rank owns a third of the table's rows, gets its own slice of every batch, and
// looks up the rows it does not own through the sharded embedding bag. The small
// linear head is replicated (its gradients are summed across ranks). The task is
// synthetic: a bag's target is the sum of a hidden per-row score, which the model
// learns; rank 0 prints the loss.
#include <torch/torch.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "tessera/core/blas.h"
#include "tessera/distributed/communicator.h"
#include "tessera/nn/sharded_embedding_bag.h"
#include "tessera/sharding/chunk.h"
#include "tessera/state/module_state.h"
#include "tessera/state/optimizer_state.h"

using namespace tessera;

namespace {

constexpr int64_t kRows = 1000, kDim = 16, kBatch = 96, kBag = 4;

struct Model : torch::nn::Module {
  Model() {
    nn::ShardedEmbeddingBagOptions o;
    o.num_embeddings = kRows;
    o.embedding_dim = kDim;
    o.mode = nn::BagMode::Mean;
    o.seed = 2024;
    o.init_scale = 0.1;
    emb = register_module("emb", std::make_shared<nn::ShardedEmbeddingBag>(o));
    torch::manual_seed(7);
    head = register_module("head", torch::nn::Linear(kDim, 1));
  }
  at::Tensor forward(const at::Tensor& bags) { return head(emb->forward(bags)); }
  std::shared_ptr<nn::ShardedEmbeddingBag> emb;
  torch::nn::Linear head{nullptr};
};

}  // namespace

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

int main(int argc, char** argv) {
  try {
    const int steps = argc > 1 ? std::stoi(argv[1]) : 60;
    auto comm = distributed::Communicator::create(distributed::World::from_env());
    const int rank = comm->rank(), world = comm->size();

    auto model = std::make_shared<Model>();
    state::configure_model(*model, comm);  // creates the sharded table
    std::printf("rank %d of %d owns rows [%lld, %lld) of %lld\n", rank, world,
                static_cast<long long>(model->emb->row_begin()),
                static_cast<long long>(model->emb->row_begin() + model->emb->row_count()),
                static_cast<long long>(kRows));
    std::fflush(stdout);

    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(0.05));
    at::Generator truth_gen = at::detail::createCPUGenerator(99);
    const at::Tensor score = at::randn({kRows}, truth_gen);  // the hidden per-row score

    double first = 0, last = 0;
    for (int step = 0; step < steps; ++step) {
      at::Generator g = at::detail::createCPUGenerator(step);
      at::Tensor bags = at::randint(kRows, {kBatch, kBag}, g, at::kLong);
      at::Tensor target = score.index_select(0, bags.flatten()).view({kBatch, kBag}).mean(1, true);
      const auto mine = sharding::chunk_range(kBatch, world, rank);
      at::Tensor my_bags = bags.narrow(0, mine.begin, mine.size);
      at::Tensor my_target = target.narrow(0, mine.begin, mine.size);

      opt.zero_grad();
      at::Tensor loss = (model->forward(my_bags) - my_target).pow(2).sum() / kBatch;
      loss.backward();
      for (auto& p : model->head->parameters()) comm->all_reduce(p.mutable_grad());
      opt.step();
      const double global = comm->all_reduce_double(loss.item<double>());
      if (step == 0) first = global;
      last = global;
      if (rank == 0 && (step % 10 == 0 || step == steps - 1)) {
        std::printf("step %d loss %.6f\n", step, global);
        std::fflush(stdout);
      }
    }
    // The whole state, table included, under FQNs.
    auto sd = state::state_dict(*model);
    auto osd = state::optimizer_state_dict(opt, *model);
    if (rank == 0) {
      std::printf("state dict:");
      for (auto& k : sd.keys()) std::printf(" %s(%s)", k.c_str(), state::kind_name(sd.at(k)));
      std::printf("\noptimizer state for %zu parameters\n", osd.dict("state").size());
      std::printf("final loss %.6f (initial %.6f)\n", last, first);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "sharded_embedding: " << e.what() << "\n";
    return 1;
  }
}
