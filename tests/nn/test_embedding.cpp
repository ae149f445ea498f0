// The row-wise sharded embedding bag: parity with an unsharded EmbeddingBag at world
// sizes 1..4, errors, and the examples/sharded_embedding program under `tessera run`.
#include <torch/torch.h>

#include <cstdio>
#include <regex>

#include "support/build_paths.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/nn/sharded_embedding_bag.h"

using namespace tessera;
using tessera::testing::run_ranks;

using namespace tessera::testing;

namespace {




}  // namespace

TEST(ShardedEmbedding, SingleProcessMatchesEmbeddingBagAndChecksInput) {
  auto c = distributed::Communicator::create(distributed::World{});
  nn::ShardedEmbeddingBagOptions o;
  o.num_embeddings = 6;
  o.embedding_dim = 3;
  o.mode = nn::BagMode::Mean;
  o.seed = 4;
  auto emb = std::make_shared<nn::ShardedEmbeddingBag>(o);
  at::Tensor bags = torch::tensor({{0, 5, 5}, {2, 3, 1}}, at::kLong);
  EXPECT_CONTAINS(error_of([&] { emb->forward(bags); }), "before configure_model()");
  state::configure_model(*emb, c);
  EXPECT_EQ(emb->parameters().size(), 1u);
  EXPECT_EQ(emb->row_count(), 6);

  auto ref = torch::nn::EmbeddingBag(torch::nn::EmbeddingBagOptions(6, 3).mode(torch::kMean));
  {
    at::NoGradGuard ng;
    ref->weight.copy_(emb->table().full_tensor());
  }
  at::Tensor out = emb->forward(bags), want = ref->forward(bags);
  EXPECT_TRUE(at::allclose(out, want)) << out << want;
  out.pow(2).sum().backward();
  want.pow(2).sum().backward();
  EXPECT_TRUE(at::allclose(emb->weight.grad(), ref->weight.grad())) << emb->weight.grad() << ref->weight.grad();

  EXPECT_CONTAINS(error_of([&] { emb->forward(torch::tensor({{0, 6}}, at::kLong)); }),
                  "rank 0 passed index 6, outside [0, 6)");
  EXPECT_CONTAINS(error_of([&] { emb->forward(torch::tensor({0, 1}, at::kLong)); }), "int64 tensor [B, L]");
  auto sd = state::state_dict(*emb);
  EXPECT_EQ(sd.keys(), std::vector<std::string>{"weight"});
  EXPECT_EQ(sd.sharded("weight").shape(), (std::vector<int64_t>{6, 3}));
}

class EmbeddingRanks : public ::testing::TestWithParam<int> {};

// Same seed, same loss curve (1e-5 relative) as torch::nn::EmbeddingBag + Linear in
// one process, for sum/Adam and mean/SGD; 9 rows leave rank 3 of 4 without rows.
TEST_P(EmbeddingRanks, TrainingMatchesUnshardedModel) {
  const int n = GetParam();
  for (std::vector<std::string> cfg : {std::vector<std::string>{"sum", "adam"}, {"mean", "sgd"}}) {
    auto res = run_ranks(n, {"embedding_parity", cfg[0], cfg[1]});
    EXPECT_RANKS_OK(res) << cfg[0] << "/" << cfg[1];
    for (int r = 0; r < n; ++r) {
      ASSERT_FALSE(res.out[r].empty()) << res.all_output();
      EXPECT_EQ(res.out[r].back(), "embedding parity ok rank " + std::to_string(r)) << res.all_output();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, EmbeddingRanks, ::testing::Values(1, 2, 3, 4));

// examples/sharded_embedding trains across `tessera run -n 3` and its loss falls.
TEST(ShardedEmbeddingExample, TrainsAcrossThreeRanks) {
  std::string worker = TESSERA_WORKER;
  const std::string example = worker.substr(0, worker.rfind('/')) + "/sharded_embedding";
  ASSERT_EQ(::access(example.c_str(), X_OK), 0) << example << " is not built (TESSERA_BUILD_EXAMPLES=ON builds it)";
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 3 -- " + example + " 40 2>&1");
  ASSERT_EQ(code, 0) << out;
  for (const char* part : {"[rank 0] rank 0 of 3 owns rows [0, 334)", "[rank 2] rank 2 of 3 owns rows [668, 1000)",
                           "state dict: emb.weight(sharded) head.weight(tensor) head.bias(tensor)"})
    EXPECT_CONTAINS(out, part);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(final loss ([0-9.]+) \(initial ([0-9.]+)\))"))) << out;
  const double final_loss = std::stod(m[1]), initial = std::stod(m[2]);
  EXPECT_LT(final_loss, 0.5 * initial) << out;
}
