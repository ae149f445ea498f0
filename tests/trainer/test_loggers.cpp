// Trainer loggers: CsvLogger (versioned run directories, metrics.csv columns and cells,
// atomic rewrite, YAML quoting of hparams.yaml), logger setup across real rank processes,
// and a Trainer writing CSV, TensorBoard and plain progress together. TensorBoardLogger
// has test_tensorboard_logger.cpp, ProgressBar test_progress_bar.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/progress_bar.h"
#include "tessera/trainer/tensorboard_logger.h"
#include "tessera/trainer/trainer.h"
#include "support/harness.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

// ======================================================================= CsvLogger

TEST(CsvLogger, VersionedRunDirectories) {
  const std::string root = temp_dir("tessera-loggers");
  trainer::CsvLogger a(root), b(root);
  a.setup(true, {});
  b.setup(true, {});
  EXPECT_EQ(a.log_dir(), root + "/lightning_logs/version_0");
  EXPECT_EQ(b.log_dir(), root + "/lightning_logs/version_1");  // the first one's directory is taken
  b.setup(true, [](const std::string&) -> std::string { throw std::runtime_error("share called again"); });
  EXPECT_EQ(b.log_dir(), root + "/lightning_logs/version_1");  // chosen once per object (fit, then test)
  EXPECT_TRUE(fs::is_directory(b.log_dir()));
  fs::create_directories(root + "/lightning_logs/version_7");
  fs::create_directories(root + "/lightning_logs/version_x");  // not a version: ignored
  trainer::CsvLogger c(root);
  c.setup(true, {});
  EXPECT_EQ(c.log_dir(), root + "/lightning_logs/version_8");

  trainer::CsvLogger fixed(root, "exp", 3), unnamed(root, "");
  fixed.setup(true, {});
  unnamed.setup(true, {});
  EXPECT_EQ(fixed.log_dir(), root + "/exp/version_3");
  EXPECT_EQ(unnamed.log_dir(), root + "/version_0");
  auto flat = trainer::CsvLogger::flat(root + "/flat/run");
  flat->log_metrics({{"x", 1}}, 0);  // used without a Trainer: sets itself up as the writer
  flat->save();
  EXPECT_EQ(flat->log_dir(), root + "/flat/run");
  EXPECT_TRUE(fs::exists(root + "/flat/run/metrics.csv"));
  EXPECT_EQ(flat->name(), "csv");

  EXPECT_EQ(trainer::next_version_dir(root), root + "/lightning_logs/version_9");
  trainer::CsvLogger named(root, "named");
  named.setup(true, {});
  EXPECT_EQ(named.log_dir(), root + "/named/version_0");
}

TEST(CsvLogger, MetricsColumnsCellsAndAtomicRewrite) {
  const std::string root = temp_dir("tessera-loggers");
  trainer::CsvLogger l(root, "run", 0);
  l.setup(true, {});
  l.log_metrics({{"train_loss", 0.5}, {"epoch", 0}}, 1);
  l.log_metrics({{"val_loss", 0.25}, {"train_loss", 0.1}, {"epoch", 0}}, 2);
  l.log_metrics({{"lr", 1e-3}}, 3);  // no epoch: empty cell
  l.save();
  const std::string path = l.log_dir() + "/metrics.csv";
  EXPECT_EQ(read_bytes(path),
            "step,epoch,train_loss,val_loss,lr\n"
            "1,0,0.5,,\n"
            "2,0,0.1,0.25,\n"
            "3,,,,0.001\n");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  // Values survive the text round trip exactly; the file is replaced, not appended.
  const double third = 1.0 / 3.0;
  l.log_metrics({{"lr", third}}, 4);
  l.save();
  const Csv csv = read_csv(path);
  ASSERT_EQ(csv.rows.size(), 4u);
  EXPECT_EQ(column_of(csv, "lr").at(4), third);
  // A reader holding the old file keeps a whole old file (rename, not rewrite in place).
  std::ifstream held(path);
  l.log_metrics({{"lr", 2}}, 5);
  l.save();
  std::string old((std::istreambuf_iterator<char>(held)), {});
  EXPECT_EQ(lines_of(old).size(), 5u);
  EXPECT_EQ(lines_of(read_bytes(path)).size(), 6u);

  EXPECT_CONTAINS(error_of([&] { l.log_metrics({{"step", 1}}, 6); }), "'step' is reserved");
  EXPECT_CONTAINS(error_of([&] { l.log_metrics({{"a,b", 1}}, 6); }), "metric name 'a,b'");
}

TEST(CsvLogger, KeepExistingRowsOfAnEarlierRun) {
  const std::string root = temp_dir("tessera-loggers");
  auto first = trainer::CsvLogger::flat(root);
  first->log_metrics({{"train_loss", 0.5}, {"epoch", 0}}, 1);
  first->log_metrics({{"train_loss", 0.25}, {"epoch", 0}}, 2);
  first->log_metrics({{"val_loss", 0.75}, {"epoch", 0}}, 2);
  first->log_metrics({{"train_loss", 0.125}, {"epoch", 1}}, 3);  // after the checkpoint at step 2
  first->log_metrics({{"train_loss", 0.0625}, {"epoch", 1}}, 4);
  first->save();
  const std::string path = root + "/metrics.csv";
  const std::string before = read_bytes(path);
  EXPECT_EQ(before, "step,epoch,train_loss,val_loss\n1,0,0.5,\n2,0,0.25,\n2,0,,0.75\n3,1,0.125,\n4,1,0.0625,\n");

  // The resumed run (from step 2) keeps rows 1-2 and redoes 3-4; a new column is added.
  auto resumed = trainer::CsvLogger::flat(root);
  resumed->keep_existing();
  resumed->setup(true, {});
  resumed->save();
  EXPECT_EQ(read_bytes(path), before);  // nothing lost before this run logs
  resumed->log_metrics({{"train_loss", 9}, {"lr", 0.5}, {"epoch", 1}}, 3);
  resumed->save();
  EXPECT_EQ(read_bytes(path), "step,epoch,train_loss,val_loss,lr\n1,0,0.5,,\n2,0,0.25,,\n2,0,,0.75,\n3,1,9,,0.5\n");

  // Without keep_existing the file is replaced (a fresh run in the same directory).
  auto fresh = trainer::CsvLogger::flat(root);
  fresh->log_metrics({{"x", 1}}, 1);
  fresh->save();
  EXPECT_EQ(read_bytes(path), "step,epoch,x\n1,,1\n");

  // A file it cannot read back is an error naming it, and is left as it was.
  write_bytes(path, "when,what\n1,2\n");
  auto bad = trainer::CsvLogger::flat(root);
  bad->keep_existing();
  EXPECT_CONTAINS(error_of([&] { bad->setup(true, {}); }), path);
  write_bytes(path, "step,epoch,a\n1,0,oops\n");
  auto bad2 = trainer::CsvLogger::flat(root);
  bad2->keep_existing();
  EXPECT_CONTAINS(error_of([&] { bad2->setup(true, {}); }), "line 2: 'oops' is not a number");
  EXPECT_EQ(read_bytes(path), "step,epoch,a\n1,0,oops\n");
}

TEST(CsvLogger, HparamsYamlQuoting) {
  const std::string root = temp_dir("tessera-loggers");
  auto l = trainer::CsvLogger::flat(root);
  l->log_hyperparams({{"lr", "0.001"},
                      {"neg", "-2"},
                      {"model", "mlp 4-8-2"},
                      {"colon", "a: b"},
                      {"hash", "x #y"},
                      {"yes", "yes"},
                      {"null", "~"},
                      {"empty", ""},
                      {"list", "[1, 2]"},
                      {"dash", "- item"},
                      {"quote", "say \"hi\"\nbye\t\\"},
                      {"key: odd", "v"}});
  EXPECT_EQ(read_bytes(root + "/hparams.yaml"),
            "colon: \"a: b\"\n"
            "dash: \"- item\"\n"
            "empty: \"\"\n"
            "hash: \"x #y\"\n"
            "\"key: odd\": v\n"
            "list: \"[1, 2]\"\n"
            "lr: 0.001\n"
            "model: mlp 4-8-2\n"
            "neg: -2\n"
            "\"null\": \"~\"\n"  // keys are quoted by the same rule
            "quote: \"say \\\"hi\\\"\\nbye\\t\\\\\"\n"
            "\"yes\": \"yes\"\n");
  EXPECT_EQ(trainer::yaml_scalar("a\x01z"), "\"a\\x01z\"");
  trainer::CsvLogger::flat(root + "/e")->log_hyperparams({});
  EXPECT_EQ(read_bytes(root + "/e/hparams.yaml"), "{}\n");
}

TEST(CsvLogger, OnlyRankZeroWritesAndErrorsReachEveryRank) {
  const std::string root = temp_dir("tessera-loggers");
  // A rank other than zero takes the directory rank zero shares and writes nothing.
  trainer::CsvLogger other(root + "/never");
  other.setup(false, [&](const std::string& mine) {
    EXPECT_EQ(mine, "");
    return root + "/from-rank-zero";
  });
  EXPECT_EQ(other.log_dir(), root + "/from-rank-zero");
  other.log_hyperparams({{"a", "b"}});
  other.log_metrics({{"x", 1}}, 1);
  other.save();
  EXPECT_FALSE(fs::exists(root + "/from-rank-zero"));
  EXPECT_FALSE(fs::exists(root + "/never"));

  // Rank zero cannot create the directory: it still shares (so no rank waits forever)
  // and every rank throws naming the directory.
  write_bytes(root + "/file", "x");
  std::string sent;
  trainer::CsvLogger zero(root + "/file/sub");
  const std::string e0 = error_of([&] { zero.setup(true, [&](const std::string& s) { return sent = s; }); });
  EXPECT_CONTAINS(e0, root + "/file/sub");
  trainer::CsvLogger one(root + "/file/sub");
  const std::string e1 = error_of([&] { one.setup(false, [&](const std::string&) { return sent; }); });
  EXPECT_CONTAINS(e1, "rank zero could not create the log directory");
  EXPECT_CONTAINS(e1, root + "/file/sub");
  EXPECT_CONTAINS(error_of([&] { trainer::CsvLogger(root).setup(false, {}); }), "needs a share function");
}

TEST(Loggers, SetupAcrossRanksPicksOneDirectory) {
  const std::string root = temp_dir("tessera-loggers");
  for (int run = 0; run < 2; ++run) {
    auto res = run_ranks(2, {"logger_setup", root}, 60);
    EXPECT_RANKS_OK(res);
    for (int r = 0; r < 2; ++r) {
      const auto& out = res.out[r];
      EXPECT_NE(std::find(out.begin(), out.end(), "csv_dir=" + root + "/lightning_logs/version_" + std::to_string(run)),
                out.end())
          << res.all_output();
      EXPECT_NE(std::find(out.begin(), out.end(), "tb_dir=" + root + "/tb/version_" + std::to_string(run)), out.end())
          << res.all_output();
    }
  }
  // Two runs: two version directories (not one per rank), rank zero's values only.
  EXPECT_FALSE(fs::exists(root + "/lightning_logs/version_2"));
  EXPECT_EQ(read_bytes(root + "/lightning_logs/version_1/metrics.csv"), "step,epoch,loss\n1,0,1\n");
  EXPECT_EQ(read_bytes(root + "/lightning_logs/version_1/hparams.yaml"), "rank: 0\n");
  const auto files = event_files(root + "/tb/version_1");
  ASSERT_EQ(files.size(), 1u);
  Records rec = read_tfrecords(read_bytes(files[0]));
  EXPECT_EQ(rec.error, "");
  ASSERT_EQ(rec.data.size(), 2u);
  EXPECT_EQ(*decode_event(rec.data[1]).values.at(0).simple_value, 1.0f);

  // A directory rank zero cannot create fails every rank, none hangs.
  write_bytes(root + "/blocker", "x");
  auto bad = run_ranks(2, {"logger_setup", root + "/blocker/sub"}, 60);
  EXPECT_RANKS_OK(bad);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(bad.out[r].empty()) << bad.all_output();
    EXPECT_CONTAINS(bad.out[r][0], "setup_error=");
    EXPECT_CONTAINS(bad.out[r][0], root + "/blocker/sub");
  }
}

// ============================================================ through the Trainer

namespace {
struct Lin : trainer::TrainingModule {
  torch::nn::Linear net{nullptr};
  torch::nn::AnyModule configure_model() override {
    at::manual_seed(3);
    net = torch::nn::Linear(3, 1);
    return torch::nn::AnyModule(net);
  }
  trainer::OptimizerConfig configure_optimizers() override {
    return std::make_shared<torch::optim::SGD>(net->parameters(), 0.05);
  }
  at::Tensor mse(const trainer::Batch& b) { return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean(); }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override { return mse(b); }
  void validation_step(const trainer::Batch& b, int64_t) override { log("val_loss", mse(b), /*prog_bar=*/true); }
  void test_step(const trainer::Batch& b, int64_t) override { log("test_loss", mse(b)); }
  std::map<std::string, std::string> hparams() const override { return {{"lr", "0.05"}}; }
};
}  // namespace

TEST(Loggers, TrainerWritesCsvTensorBoardAndPlainProgress) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 2;  // 12 samples, batch 4: 3 steps per epoch
  o.log_every_n_steps = 2;
  o.loggers = {std::make_shared<trainer::CsvLogger>(tmp.path, "csv"),
               std::make_shared<trainer::TensorBoardLogger>(tmp.path, "tb")};
  o.enable_progress_bar = true;
  o.progress_bar.tty = false;
  trainer::Trainer t(o);
  Lin m;
  ::testing::internal::CaptureStderr();
  t.fit(m, regression_data(12), regression_data(8, 0.5));
  t.test(m, regression_data(8, 0.7));
  const std::string err = ::testing::internal::GetCapturedStderr();

  EXPECT_EQ(t.log_dir(), tmp.path + "/csv/version_0");
  const Csv csv = read_csv(t.log_dir() + "/metrics.csv");
  const auto tb = scalars_in(tmp.path + "/tb/version_0");
  EXPECT_EQ(read_bytes(tmp.path + "/tb/version_0/hparams.yaml"), "lr: 0.05\n");
  // The same values at the same steps in both loggers (TensorBoard keeps floats).
  for (const std::string name : {"train_loss", "val_loss", "test_loss"})
    expect_tensorboard_matches_csv(tb, name, column_of(csv, name));
  EXPECT_EQ(column_of(csv, "train_loss").size(), 3u);  // steps 2, 4, 6
  EXPECT_EQ(column_of(csv, "val_loss").size(), 2u);    // once per epoch

  // Plain progress output: no carriage returns, a summary per stage.
  EXPECT_EQ(err.find('\r'), std::string::npos) << err;
  EXPECT_CONTAINS(err, "train epoch 0: 3/3");
  EXPECT_CONTAINS(err, "train epoch 1: 3/3");
  EXPECT_CONTAINS(err, "validate: 2/2");
  EXPECT_CONTAINS(err, "test: 2/2");
}
