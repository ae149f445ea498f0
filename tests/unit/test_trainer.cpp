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

#include "test_util.h"
#include "tessera/trainer/trainer.h"
#include "unit/harness.h"

using namespace tessera;
using tessera::testing::run_ranks;
namespace fs = std::filesystem;

using namespace tessera::testing;

namespace {

struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/tessera-trainer-XXXXXX";
    const char* d = ::mkdtemp(tmpl);
    if (!d) throw std::runtime_error("mkdtemp failed");
    path = d;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

struct Mlp : trainer::TrainingModule {
  torch::nn::Sequential net;
  int epochs_started = 0, epochs_ended = 0;
  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    net = torch::nn::Sequential(torch::nn::Linear(3, 6), torch::nn::Tanh(), torch::nn::Linear(6, 1));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  std::vector<fabric::OptimizerPtr> configure_optimizers() override {
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

trainer::TensorData data(int64_t n) {
  at::Tensor x = at::cos(at::arange(n * 3, at::kFloat).reshape({n, 3}) * 0.7);
  return {x, x.sum(1, /*keepdim=*/true).sin()};
}

trainer::TrainerOptions local_options(const std::string& root) {
  trainer::TrainerOptions o;
  o.fabric.accelerator = "cpu";
  o.default_root_dir = root;
  o.batch_size = 4;
  o.log_every_n_steps = 1;
  return o;
}

struct Csv {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::string col(size_t row, const std::string& name) const {
    for (size_t i = 0; i < header.size(); ++i)
      if (header[i] == name) return i < rows[row].size() ? rows[row][i] : "";
    return "<no column " + name + ">";
  }
};

Csv read_csv(const std::string& path) {
  Csv c;
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot read " << path;
  std::string line;
  bool first = true;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    std::string cell;
    while (std::getline(ss, cell, ',')) cells.push_back(cell);
    if (!line.empty() && line.back() == ',') cells.emplace_back();
    if (first) c.header = cells;
    else c.rows.push_back(cells);
    first = false;
  }
  return c;
}

std::map<int64_t, double> losses_of(const Csv& c) {
  std::map<int64_t, double> out;
  for (size_t r = 0; r < c.rows.size(); ++r) out[std::stoll(c.col(r, "step"))] = std::stod(c.col(r, "train_loss"));
  return out;
}

void expect_same(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t from,
                 const std::string& what, int64_t to = INT64_MAX) {
  int compared = 0;
  for (auto& [step, v] : want) {
    if (step < from || step > to) continue;
    ASSERT_TRUE(got.count(step)) << what << ": no loss at step " << step;
    EXPECT_NEAR(got.at(step), v, 1e-5 * std::abs(v)) << what << " step " << step;
    ++compared;
  }
  EXPECT_GT(compared, 0) << what;
}

std::string logdir_of(const tessera::testing::RanksResult& r) {
  auto it = r.out.find(0);
  if (it == r.out.end()) return "";
  for (auto& l : it->second)
    if (l.rfind("logdir ", 0) == 0) return l.substr(7);
  return "";
}

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
  auto full = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/full", "7"}, 60);
  EXPECT_RANKS_OK(full);
  auto want = losses_of(read_csv(logdir_of(full) + "/metrics.csv"));
  ASSERT_EQ(want.size(), 7u) << full.all_output();

  auto first = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/resume", "3"}, 60);  // mid-epoch (4 batches/epoch)
  EXPECT_RANKS_OK(first);
  auto second = run_ranks(2, {"trainer_fit", "ddp", tmp.path + "/resume", "7", "last"}, 60);
  EXPECT_RANKS_OK(second);
  expect_same(losses_of(read_csv(logdir_of(second) + "/metrics.csv")), want, 4, "ddp resume");

  // FSDP: the same losses as DDP, and its last checkpoint (Full by default) resumes too.
  auto fsdp = run_ranks(2, {"trainer_fit", "fsdp", tmp.path + "/fsdp", "3"}, 60);
  EXPECT_RANKS_OK(fsdp);
  expect_same(losses_of(read_csv(logdir_of(fsdp) + "/metrics.csv")), want, 1, "fsdp vs ddp", 3);
  auto fsdp2 = run_ranks(2, {"trainer_fit", "fsdp", tmp.path + "/fsdp", "7", "last"}, 60);
  EXPECT_RANKS_OK(fsdp2);
  expect_same(losses_of(read_csv(logdir_of(fsdp2) + "/metrics.csv")), want, 4, "fsdp resume");
}

namespace {
}  // namespace

TEST(TrainerLaunch, ExampleRunsAndResumes) {
  const std::string exe = std::string(TESSERA_BINARY_DIR) + "/bin/trainer_mlp";
  if (!fs::exists(exe)) GTEST_SKIP() << exe << " not built (examples disabled)";
  TempDir tmp;
  const std::string env =
      "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE -u MASTER_ADDR -u MASTER_PORT -u TESSERA_LAUNCHED ";
  auto [rc, out] = run_command(env + exe + " --devices 2 --steps 20 --root " + tmp.path);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[rank 0] epoch 0 done at step 16"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] finished at step 20"), std::string::npos) << out;
  EXPECT_TRUE(fs::is_regular_file(tmp.path + "/checkpoints/last.ckpt")) << out;
  auto [rc2, out2] = run_command(env + exe + " --devices 2 --steps 25 --root " + tmp.path + " --resume");
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("[rank 0] finished at step 25"), std::string::npos) << out2;
  Csv c = read_csv(tmp.path + "/lightning_logs/version_1/metrics.csv");
  ASSERT_EQ(c.rows.size(), 1u);  // log_every_n_steps=5: only step 25 after resuming at 20
  EXPECT_EQ(c.col(0, "step"), "25");
  EXPECT_EQ(c.col(0, "epoch"), "1");
  EXPECT_EQ(c.col(0, "batch_rows"), "16");
}

TEST(TrainerDocs, DocQuotesTheCompiledExample) {
  const std::string doc = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/docs/trainer.md");
  const std::string code = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/examples/trainer_mlp/main.cpp");
  const std::string cmake = read_bytes(std::string(TESSERA_SOURCE_DIR) + "/examples/trainer_mlp/CMakeLists.txt");
  EXPECT_NE(doc.find("```cpp\n" + code + "```"), std::string::npos) << "docs/trainer.md does not quote main.cpp verbatim";
  EXPECT_NE(doc.find("```cmake\n" + cmake + "```"), std::string::npos) << "docs/trainer.md does not quote CMakeLists.txt";
}
