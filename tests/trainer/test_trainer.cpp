// Trainer: fit loop limits, CSV logs, ModelCheckpoint(save_last), exact mid-epoch
// resume (in-process), and DDP/FSDP fits with resume through real processes.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include "support/build_paths.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/strategy/fsdp.h"
#include "tessera/trainer/trainer.h"
#include "support/harness.h"

using namespace tessera;
using tessera::testing::run_ranks;
namespace fs = std::filesystem;

using namespace tessera::testing;

namespace {

struct Mlp : trainer::TrainingModule {
  torch::nn::Sequential net;
  int epochs_started = 0, epochs_ended = 0;
  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    net = torch::nn::Sequential(torch::nn::Linear(3, 6), torch::nn::Tanh(), torch::nn::Linear(6, 1));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9))};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t batch_idx) override {
    log("batch_idx", static_cast<double>(batch_idx));
    return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
  }
  void on_train_epoch_start(int64_t) override { ++epochs_started; }
  void on_train_epoch_end(int64_t) override { ++epochs_ended; }
  std::map<std::string, std::string> hparams() const override { return {{"lr", "0.1"}, {"note", "a: b"}}; }
};

trainer::TensorData data(int64_t n) { return regression_data(n); }

}  // namespace

TEST(TrainerLocal, FitsForMaxEpochsWithLogsAndLastCheckpoint) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 2;  // 10 samples, batch 4: 3 batches per epoch (the last one partial)
  trainer::Trainer t(o);
  Mlp m;
  t.fit(m, data(10));
  EXPECT_EQ(t.global_step(), 6);
  EXPECT_EQ(t.current_epoch(), 2);
  EXPECT_EQ(m.epochs_started, 2);
  EXPECT_EQ(m.epochs_ended, 2);
  EXPECT_EQ(t.log_dir(), tmp.path + "/lightning_logs/version_0");
  Csv c = read_csv(t.log_dir() + "/metrics.csv");
  EXPECT_EQ(c.header, (std::vector<std::string>{"step", "epoch", "batch_idx", "train_loss"}));
  ASSERT_EQ(c.rows.size(), 6u);
  for (size_t r = 0; r < 6; ++r) {
    EXPECT_EQ(c.col(r, "step"), std::to_string(r + 1));
    EXPECT_EQ(c.col(r, "epoch"), r < 3 ? "0" : "1");
    EXPECT_EQ(c.col(r, "batch_idx"), std::to_string(r % 3));
  }
  EXPECT_LT(std::stod(c.col(5, "train_loss")), std::stod(c.col(0, "train_loss")));
  std::ifstream hp(t.log_dir() + "/hparams.yaml");
  std::string yaml((std::istreambuf_iterator<char>(hp)), std::istreambuf_iterator<char>());
  EXPECT_EQ(yaml, "lr: 0.1\nnote: \"a: b\"\n");
  EXPECT_TRUE(fs::is_regular_file(tmp.path + "/checkpoints/last.ckpt"));  // Full by default
  EXPECT_EQ(t.last_checkpoint_path(), tmp.path + "/checkpoints/last.ckpt");

  // A second run in the same root gets the next version directory.
  trainer::Trainer t2(o);
  Mlp m2;
  t2.fit(m2, data(10));
  EXPECT_EQ(t2.log_dir(), tmp.path + "/lightning_logs/version_1");
  EXPECT_THROW(t2.fit(m2, data(10)), Error);  // one fit per Trainer
}

TEST(TrainerLocal, ResumeMidEpochMatchesAnUninterruptedRun) {
  TempDir a, b;
  auto full_opts = local_options(a.path);
  full_opts.max_steps = 8;
  trainer::Trainer full(full_opts);
  Mlp m;
  full.fit(m, data(10));
  auto want = losses_of(read_csv(full.log_dir() + "/metrics.csv"));
  ASSERT_EQ(want.size(), 8u);

  auto part = local_options(b.path);
  part.max_steps = 4;  // stops after the first batch of epoch 1
  {
    trainer::Trainer t(part);
    Mlp m1;
    t.fit(m1, data(10));
  }
  part.max_steps = 8;
  trainer::Trainer t(part);
  Mlp m2;
  t.fit(m2, data(10), "last");
  EXPECT_EQ(t.global_step(), 8);
  auto got = losses_of(read_csv(t.log_dir() + "/metrics.csv"));
  EXPECT_EQ(got.size(), 4u);
  EXPECT_EQ(got.count(4), 0u);
  expect_same(got, want, 5, "resumed at step 4");
}

TEST(TrainerLocal, RefusesBadOptionsAndMissingCheckpoint) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.batch_size = 0;
  try {
    trainer::Trainer t(o);
    ADD_FAILURE() << "batch_size 0 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TrainerOptions.batch_size"), std::string::npos) << e.what();
  }
  o = local_options(tmp.path);
  o.fabric.strategy = "single";
  o.fabric.devices = 2;
  EXPECT_THROW(trainer::Trainer t(o), Error);
  o.fabric.devices = 1;
  trainer::Trainer t(o);
  Mlp m;
  try {
    t.fit(m, data(10), "last");
    ADD_FAILURE() << "missing last checkpoint accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("last.ckpt"), std::string::npos) << e.what();
  }
}

TEST(TrainerDist, DdpAndFsdpFitAndResumeExactlyOnTwoRanks) {
  TempDir tmp;
  const std::string drop = "0.1";  // dropout: every rank's RNG state must resume too
  auto full = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/full", "7", "-", "3", "1", "20", drop}, 60);
  EXPECT_RANKS_OK(full);
  const Csv full_csv = read_csv(logdir_of(full) + "/metrics.csv");
  auto want = losses_of(full_csv);
  ASSERT_EQ(want.size(), 7u) << full.all_output();
  // Validation every 2 batches (4 per epoch: steps 2, 4, 6), the StepLR(3, 0.5) lr logged.
  auto val = column_of(full_csv, "val_loss");
  EXPECT_EQ(val.size(), 3u);
  EXPECT_TRUE(val.count(2) && val.count(4) && val.count(6));
  auto lr = column_of(full_csv, "lr-Adam");
  EXPECT_DOUBLE_EQ(lr.at(3), 0.05);
  EXPECT_DOUBLE_EQ(lr.at(4), 0.025);

  // Stops mid-epoch (4 batches per epoch) and right after a validation-less step.
  auto first = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/resume", "3", "-", "3", "1", "20", drop}, 60);
  EXPECT_RANKS_OK(first);
  auto second = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/resume", "7", "last", "3", "1", "20", drop}, 60);
  EXPECT_RANKS_OK(second);
  const Csv resumed = read_csv(logdir_of(second) + "/metrics.csv");
  expect_same(losses_of(resumed), want, 4, "ddp resume");
  expect_same(column_of(resumed, "val_loss"), val, 4, "ddp resume validation");
  expect_same(column_of(resumed, "lr-Adam"), lr, 4, "ddp resume lr");

  // FSDP: the same losses as DDP, and its last checkpoint (Full by default) resumes too.
  auto fsdp = run_ranks(2, {"trainer_fit", "fsdp", tmp.path + "/fsdp", "3", "-", "3", "1", "20", drop}, 60);
  EXPECT_RANKS_OK(fsdp);
  EXPECT_TRUE(fs::is_regular_file(tmp.path + "/fsdp/checkpoints/last.ckpt"));
  expect_same(losses_of(read_csv(logdir_of(fsdp) + "/metrics.csv")), want, 1, "fsdp vs ddp", 3);
  auto fsdp2 = run_ranks(2, {"trainer_fit", "fsdp", tmp.path + "/fsdp", "7", "last", "3", "1", "20", drop}, 60);
  EXPECT_RANKS_OK(fsdp2);
  expect_same(losses_of(read_csv(logdir_of(fsdp2) + "/metrics.csv")), want, 4, "fsdp resume");
}

// 2 ranks x batch 3 stopped mid-epoch, resumed on 1 rank x batch 6 (the same global
// batch; 20 samples split evenly by both world sizes): the sampler position is
// translated through global samples, the sharded checkpoint is resharded.
TEST(TrainerDist, ResumesFromTwoRanksOnOne) {
  TempDir tmp;
  auto full = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/full", "7"}, 60);
  EXPECT_RANKS_OK(full);
  auto want = losses_of(read_csv(logdir_of(full) + "/metrics.csv"));
  ASSERT_EQ(want.size(), 7u) << full.all_output();
  auto first = run_ranks(2, {"trainer_fit", "fsdp-sharded", tmp.path + "/resume", "3"}, 60);
  EXPECT_RANKS_OK(first);
  EXPECT_TRUE(fs::is_directory(tmp.path + "/resume/checkpoints/last.ckpt"));  // sharded on request
  auto second = run_ranks(1, {"trainer_fit", "fsdp-sharded", tmp.path + "/resume", "7", "last", "6"}, 60);
  EXPECT_RANKS_OK(second);
  expect_same(losses_of(read_csv(logdir_of(second) + "/metrics.csv")), want, 4, "2 -> 1 rank resume");

  // A position 1 rank cannot reach evenly on 2 ranks: 1 rank x batch 3 stopped after 1 step (3 samples).
  auto odd = run_ranks(1, {"trainer_fit", "ddp", tmp.path + "/odd", "1"}, 60);
  EXPECT_RANKS_OK(odd);
  auto refused = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/odd", "4", "last"}, 60);
  EXPECT_NE(refused.launch.exit_code, 0);
  EXPECT_NE(refused.all_output().find("which 2 ranks cannot split evenly"), std::string::npos) << refused.all_output();
}

// Each rank restores its own row of the generator states, from its own data file: a
// rank whose row is damaged once failed alone, and the other went on into training and
// waited in its first collective until the communicator's timeout. Now every rank fails
// at once, naming the rank that could not read its row.
TEST(TrainerDist, DamagedRngRowFailsEveryRankNamingIt) {
  TempDir tmp;
  auto first = run_ranks(2, {"trainer_fit", "fsdp-sharded", tmp.path + "/rng", "3"}, 60);
  EXPECT_RANKS_OK(first);
  // One byte of rank 1's row of rng.cpu, which only the restore of the RNG states reads
  // (its own checksum block: Fabric::load reads the model and optimizer and succeeds).
  const std::string data = tmp.path + "/rng/checkpoints/last.ckpt/data-rank00001.safetensors";
  uint64_t at = 0;
  {
    checkpoint::SafetensorsReader r(data);
    const checkpoint::TensorEntry* e = r.find("rng.cpu");
    ASSERT_NE(e, nullptr) << data << " holds no row of rng.cpu";
    ASSERT_GT(e->nbytes(), 0u);
    at = e->begin + e->nbytes() / 2;
  }
  std::string bytes = read_bytes(data);
  bytes[at] = static_cast<char>(~bytes[at]);
  write_bytes(data, bytes);

  // Rank 0 prints its error only if it learned rank 1's: left to wait in a collective, it
  // would be stopped by the launcher once rank 1 exited, with nothing printed.
  auto resumed = run_ranks(2, {"trainer_fit", "fsdp-sharded", tmp.path + "/rng", "5", "last"}, 60,
                           {{"TESSERA_TEST_TIMEOUT_MS", "20000"}});
  EXPECT_NE(resumed.launch.exit_code, 0) << resumed.all_output();
  for (int rank : {0, 1}) {
    std::string error;
    for (const auto& l : resumed.out[rank])
      if (l.rfind("fit error: ", 0) == 0) error = l;
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_NE(error.find("restoring the random generator states"), std::string::npos) << resumed.all_output();
    EXPECT_NE(error.find("rank 1: "), std::string::npos) << error;
    EXPECT_NE(error.find("rng.cpu"), std::string::npos) << error;
  }
}

// accumulate_grad_batches=2 at batch 3 equals batch 6 on 2 ranks (DDP: the first
// micro-batch's backward does not synchronize).
TEST(TrainerDist, AccumulationEqualsTheLargeBatchOnTwoRanks) {
  TempDir tmp;
  auto big = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/big", "4", "-", "6", "1", "24"}, 60);
  EXPECT_RANKS_OK(big);
  auto acc = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/acc", "4", "-", "3", "2", "24"}, 60);
  EXPECT_RANKS_OK(acc);
  auto want = losses_of(read_csv(logdir_of(big) + "/metrics.csv"));
  ASSERT_EQ(want.size(), 4u);
  expect_same(losses_of(read_csv(logdir_of(acc) + "/metrics.csv")), want, 1, "accumulated vs large batch");
}

// ModelCheckpoint top-k with sharded (directory) checkpoints on 2 ranks, decisions from
// rank zero's unsynchronized score, EarlyStopping stopping both ranks at the same step,
// and a resumed run continuing the top-k bookkeeping (removing the earlier run's files).
TEST(TrainerDist, TopKCheckpointsAndEarlyStoppingOnTwoRanks) {
  TempDir tmp;
  auto lines = [](const RanksResult& r, int rank, const std::string& prefix) {
    std::vector<std::string> out;
    for (auto& l : r.out.count(rank) ? r.out.at(rank) : std::vector<std::string>{})
      if (l.rfind(prefix, 0) == 0) out.push_back(l);
    return out;
  };
  auto run = run_ranks(2, {"trainer_topk", "fsdp-sharded", tmp.path + "/a", "8"}, 60);
  EXPECT_RANKS_OK(run);
  // Scores 5 3 4 1 2 6: best 1 (epoch 3), then 2 and 6 do not improve: stops after epoch 5.
  const std::vector<std::string> kept = {"kept epoch=3-score=1.0.ckpt 1", "kept epoch=4-score=2.0.ckpt 2"};
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(lines(run, r, "kept "), kept) << run.all_output();
    EXPECT_EQ(lines(run, r, "stopped "), std::vector<std::string>{"stopped 5 6"}) << run.all_output();
  }
  EXPECT_EQ(lines(run, 0, "best "), std::vector<std::string>{"best epoch=3-score=1.0.ckpt"});
  EXPECT_EQ(entries(tmp.path + "/a/checkpoints"),
            (std::vector<std::string>{"epoch=3-score=1.0.ckpt", "epoch=4-score=2.0.ckpt", "last.ckpt"}));
  EXPECT_TRUE(fs::is_directory(tmp.path + "/a/checkpoints/epoch=3-score=1.0.ckpt"));

  // The same in two runs: epochs 0-2 (keeps 3 and 4 of the scores 5 3 4), then resumed.
  auto part = run_ranks(2, {"trainer_topk", "fsdp-sharded", tmp.path + "/b", "3"}, 60);
  EXPECT_RANKS_OK(part);
  EXPECT_EQ(entries(tmp.path + "/b/checkpoints"),
            (std::vector<std::string>{"epoch=1-score=3.0.ckpt", "epoch=2-score=4.0.ckpt", "last.ckpt"}));
  auto rest = run_ranks(2, {"trainer_topk", "fsdp-sharded", tmp.path + "/b", "8", "last"}, 60);
  EXPECT_RANKS_OK(rest);
  EXPECT_EQ(lines(rest, 0, "kept "), kept) << rest.all_output();
  EXPECT_EQ(lines(rest, 1, "stopped "), std::vector<std::string>{"stopped 5 6"}) << rest.all_output();
  EXPECT_EQ(entries(tmp.path + "/b/checkpoints"), entries(tmp.path + "/a/checkpoints"));
}

TEST(TrainerLaunch, ExampleRunsAndResumes) {
  const std::string exe = std::string(TESSERA_BINARY_DIR) + "/bin/trainer_mlp";
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " not built (examples disabled)";
  TempDir tmp;
  auto [rc, out] = run_command(kNoLauncherEnv + exe + " --devices 2 --steps 20 --root " + tmp.path);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[rank 0] epoch 0 done at step 16"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] finished at step 20"), std::string::npos) << out;
  // The progress bar (not a TTY here: plain summary lines), on rank zero only.
  EXPECT_NE(out.find("[rank 0] train epoch 0: 16/16 [step 16/20]"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] validate: 4/4"), std::string::npos) << out;
  EXPECT_EQ(out.find("[rank 1] train epoch"), std::string::npos) << out;
  // Top-2 by val_loss at steps 10 and 20 (validation at 8 and 16) plus last.ckpt.
  auto files = entries(tmp.path + "/checkpoints");
  ASSERT_EQ(files.size(), 3u) << out;
  EXPECT_EQ(files[0].rfind("epoch=0-step=10-val_loss=", 0), 0u) << files[0];
  EXPECT_EQ(files[1].rfind("epoch=1-step=20-val_loss=", 0), 0u) << files[1];
  EXPECT_EQ(files[2], "last.ckpt");
  const Csv first = read_csv(tmp.path + "/lightning_logs/version_0/metrics.csv");
  EXPECT_EQ(column_of(first, "val_loss").size(), 3u);  // steps 8, 16 and the final validate()
  EXPECT_EQ(column_of(first, "lr-AdamW").size(), 4u);   // logged steps 5, 10, 15, 20
  auto [rc2, out2] = run_command(kNoLauncherEnv + exe + " --devices 2 --steps 25 --root " + tmp.path + " --resume");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("[rank 0] finished at step 25"), std::string::npos) << out2;
  const Csv c = read_csv(tmp.path + "/lightning_logs/version_1/metrics.csv");
  auto rows = column_of(c, "batch_rows");  // log_every_n_steps=5: only step 25 after resuming at 20
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows.begin()->first, 25);
  EXPECT_EQ(rows.begin()->second, 16);
  EXPECT_EQ(column_of(c, "val_loss").count(24), 1u);  // epoch 1's mid-epoch validation
}

TEST(TrainerDocs, DocQuotesTheCompiledExample) {
  const std::string doc = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/docs/trainer.md");
  const std::string code = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/examples/trainer_mlp/main.cpp");
  const std::string cmake = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/examples/trainer_mlp/CMakeLists.txt");
  EXPECT_NE(doc.find("```cpp\n" + code + "```"), std::string::npos) << "docs/trainer.md does not quote main.cpp verbatim";
  EXPECT_NE(doc.find("```cmake\n" + cmake + "```"), std::string::npos) << "docs/trainer.md does not quote CMakeLists.txt";
}

namespace {
// A model whose pieces configure_model may build through init_module, the strategy's
// module-init context.
struct Pieces : trainer::TrainingModule {
  bool use_init;
  std::string refused;  // init_module's error outside configure_model
  torch::nn::Sequential net;
  explicit Pieces(bool u) : use_init(u) {}
  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    auto lin = [](int64_t i, int64_t o) { return [=] { return torch::nn::AnyModule(torch::nn::Linear(i, o)); }; };
    net = torch::nn::Sequential();
    net->push_back(use_init ? init_module(lin(3, 6)) : lin(3, 6)());
    net->push_back(torch::nn::Tanh());
    net->push_back(use_init ? init_module(lin(6, 1)) : lin(6, 1)());
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    return {std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1))};
  }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override {
    if (refused.empty()) refused = error_of([&] { init_module([] { return torch::nn::AnyModule(torch::nn::Tanh()); }); });
    return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
  }
};
}  // namespace

// Under FSDP each piece built through init_module is a unit from the start (sharded as it
// is built); training equals the same model built plainly; outside configure_model,
// init_module is refused.
TEST(TrainerLocal, InitModuleBuildsFsdpUnitsInsideConfigureModel) {
  std::vector<at::Tensor> finals[2];
  for (int use = 0; use < 2; ++use) {
    TempDir tmp;
    auto o = local_options(tmp.path);
    o.fabric.strategy = "fsdp";
    o.max_steps = 4;
    o.enable_checkpointing = false;
    trainer::Trainer t(o);
    Pieces m(use == 1);
    t.fit(m, data(16));
    EXPECT_EQ(std::dynamic_pointer_cast<strategy::FsdpUnitImpl>(m.net->ptr(0)) != nullptr, use == 1);
    EXPECT_CONTAINS(m.refused, "only valid inside configure_model");
    for (auto& p : m.net->parameters()) finals[use].push_back(p.detach().clone());
  }
  ASSERT_EQ(finals[0].size(), finals[1].size());
  for (size_t i = 0; i < finals[0].size(); ++i) EXPECT_TRUE(at::equal(finals[0][i], finals[1][i])) << "parameter " << i;
}
