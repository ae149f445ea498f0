// Trainer loops on one process: validation / test loops and their metrics, batch limits,
// gradient accumulation and clipping, LR schedulers, and several loggers at once.
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>

#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/tensorboard_logger.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

TEST(TrainerLoops, ValidatesEveryHalfEpochAndAveragesOverSamples) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 2;  // 16 samples, batch 4: 4 batches per epoch
  o.val_check_interval = 0.5;
  o.eval_batch_size = 4;  // 10 validation samples: batches of 4, 4, 2
  trainer::Trainer t(o);
  Reg m;
  const auto val = regression_data(10, 0.3), test = regression_data(7, 0.9);
  t.fit(m, regression_data(16), val);
  EXPECT_EQ(t.global_step(), 8);
  EXPECT_EQ(m.validations, 4);
  EXPECT_EQ(m.val_batches, 12);
  const Csv c = read_csv(t.log_dir() + "/metrics.csv");
  auto v = column_of(c, "val_loss");
  EXPECT_EQ(v.size(), 4u);
  for (int64_t s : {2, 4, 6, 8}) EXPECT_TRUE(v.count(s)) << "no validation at step " << s;
  EXPECT_EQ(losses_of(c).size(), 8u);
  ASSERT_TRUE(t.callback_metrics().count("val_loss"));
  EXPECT_NEAR(t.callback_metrics().at("val_loss"), full_mse(m, val), 1e-6);  // weighted by batch size
  EXPECT_TRUE(t.progress_bar_metrics().count("val_loss"));

  // validate() and test() after fit: one pass, the averages over every sample.
  auto r = t.validate(m, val);
  EXPECT_NEAR(r.at("val_loss"), full_mse(m, val), 1e-6);
  auto tr = t.test(m, test);
  EXPECT_NEAR(tr.at("test_loss"), full_mse(m, test), 1e-6);
  EXPECT_EQ(m.test_batches, 2);
  EXPECT_EQ(m.validations, 5);

  // A fresh Trainer validates the weights of the fit's last checkpoint the same way.
  trainer::Trainer t2(o);
  Reg fresh;
  EXPECT_NEAR(t2.validate(fresh, val, t.last_checkpoint_path()).at("val_loss"), r.at("val_loss"), 1e-7);
}

TEST(TrainerLoops, LimitsBatchesAndValidatesEveryNEpochs) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 4;
  o.limit_train_batches = 2;        // of 4
  o.limit_val_batches = 0.5;        // of 3 (10 samples at batch 4): 1 batch
  o.check_val_every_n_epoch = 2;    // epochs 1 and 3
  o.val_check_interval = 1;         // every batch of those epochs
  o.num_sanity_val_steps = 2;       // one batch (the limit) before training, results discarded
  trainer::Trainer t(o);
  Reg m;
  t.fit(m, regression_data(16), regression_data(10));
  EXPECT_EQ(t.global_step(), 8);
  EXPECT_EQ(t.num_training_batches(), 2);
  EXPECT_EQ(m.validations, 4);
  EXPECT_EQ(m.val_batches, 5);
  auto v = column_of(read_csv(t.log_dir() + "/metrics.csv"), "val_loss");
  EXPECT_EQ(v.size(), 4u);
  for (int64_t s : {3, 4, 7, 8}) EXPECT_TRUE(v.count(s)) << "no validation at step " << s;

  TempDir tmp2;
  auto o2 = local_options(tmp2.path);
  o2.max_epochs = 1;
  o2.limit_train_batches = 0.5;
  o2.limit_val_batches = 0;  // no validation at all
  trainer::Trainer t2(o2);
  Reg m2;
  t2.fit(m2, regression_data(16), regression_data(10));
  EXPECT_EQ(t2.global_step(), 2);
  EXPECT_EQ(m2.validations, 0);
}

TEST(TrainerLoops, AccumulationEqualsTheLargeBatch) {
  // 12 samples: batch 2 x 4 micro-batches (the epoch's last step has only 2) against batch 8.
  auto run = [](int64_t batch, int64_t accumulate, std::map<int64_t, double>* losses) {
    TempDir tmp;
    auto o = local_options(tmp.path);
    o.max_epochs = 2;
    o.batch_size = batch;
    o.accumulate_grad_batches = accumulate;
    trainer::Trainer t(o);
    Reg m;
    m.momentum = 0.9;
    t.fit(m, regression_data(12));
    EXPECT_EQ(t.global_step(), 4);
    *losses = losses_of(read_csv(t.log_dir() + "/metrics.csv"));
    return params_of(m);
  };
  std::map<int64_t, double> l8, l2;
  auto p8 = run(8, 1, &l8);     // steps of 8 and 4 samples
  auto p2 = run(2, 4, &l2);     // 4 micro-batches of 2, then 2 of 2
  ASSERT_EQ(p8.size(), p2.size());
  for (size_t i = 0; i < p8.size(); ++i) EXPECT_TRUE(at::allclose(p8[i], p2[i], 1e-5, 1e-6)) << "parameter " << i;
  expect_same(l2, l8, 1, "accumulated train_loss");
}

TEST(TrainerLoops, ClipsGradientsByNormAndByValue) {
  for (const std::string algo : {"norm", "value"}) {
    TempDir tmp;
    auto o = local_options(tmp.path);
    o.max_steps = 1;
    o.gradient_clip_val = 1e-3;
    o.gradient_clip_algorithm = algo;
    trainer::Trainer t(o);
    Reg m;
    m.lr = 1.0;  // plain SGD: the update is the clipped gradient
    at::manual_seed(9);
    torch::nn::Sequential fresh(torch::nn::Linear(3, 6), torch::nn::Tanh(), torch::nn::Dropout(0.0),
                                torch::nn::Linear(6, 1));
    std::vector<at::Tensor> before;
    for (auto& p : fresh->parameters()) before.push_back(p.detach().clone());
    t.fit(m, regression_data(4));
    auto after = params_of(m);
    double sq = 0, maxabs = 0;
    for (size_t i = 0; i < after.size(); ++i) {
      at::Tensor d = after[i] - before[i];
      sq += d.pow(2).sum().item<double>();
      maxabs = std::max(maxabs, d.abs().max().item<double>());
    }
    // float32 parameters near 0.5: the difference carries about 6e-8 of rounding.
    if (algo == "norm") EXPECT_NEAR(std::sqrt(sq), 1e-3, 1e-6) << algo;
    else EXPECT_NEAR(maxabs, 1e-3, 2e-7) << algo;
  }
}

TEST(TrainerSchedulers, ClosedFormLearningRatesAndState) {
  at::Tensor p = at::zeros({2}).requires_grad_();
  auto sgd = [&](double lr) { return std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{p}, lr); };
  auto opt = sgd(1.0);
  trainer::StepLR step(opt, 2, 0.5);
  std::vector<double> got;
  for (int i = 0; i < 5; ++i) {
    got.push_back(step.last_lr()[0]);
    step.step();
  }
  EXPECT_EQ(got, (std::vector<double>{1, 1, 0.5, 0.5, 0.25}));
  auto opt2 = sgd(2.0);
  trainer::WarmupCosineLR cos(opt2, 2, 6, 0.1);
  std::vector<double> c;
  for (int i = 0; i < 8; ++i) {
    c.push_back(cos.last_lr()[0]);
    cos.step();
  }
  EXPECT_DOUBLE_EQ(c[0], 1.0);  // warmup: 2 * 1/2
  EXPECT_DOUBLE_EQ(c[1], 2.0);
  EXPECT_DOUBLE_EQ(c[2], 2.0);  // cosine starts at base
  EXPECT_NEAR(c[4], 2.0 * (0.1 + 0.9 * 0.5), 1e-12);  // half way
  EXPECT_NEAR(c[6], 0.2, 1e-12);
  EXPECT_NEAR(c[7], 0.2, 1e-12);  // stays at the minimum
  // State round trip into a fresh scheduler on a fresh optimizer.
  auto opt3 = sgd(2.0);
  trainer::WarmupCosineLR cos2(opt3, 2, 6, 0.1);
  cos2.load_state_dict(cos.state_dict());
  EXPECT_EQ(cos2.count(), 8);
  EXPECT_DOUBLE_EQ(cos2.last_lr()[0], cos.last_lr()[0]);
  EXPECT_CONTAINS(error_of([&] { step.load_state_dict(cos.state_dict()); }), "'WarmupCosineLR' state");
  EXPECT_CONTAINS(error_of([&] { trainer::StepLR bad(opt, 0); }), "StepLR: step_size");
  EXPECT_CONTAINS(error_of([&] { trainer::WarmupCosineLR bad(opt, 5, 5); }), "total_steps (5)");
  trainer::LambdaLR lam(sgd(1.0), [](int64_t n) { return 1.0 / (n + 1); });
  lam.step();
  EXPECT_DOUBLE_EQ(lam.last_lr()[0], 0.5);
}

// Several loggers receive the same rows; log_dir() is the first one's.
TEST(TrainerLoggers, CsvAndTensorBoardTogether) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_steps = 3;
  o.loggers = {trainer::CsvLogger::flat(tmp.path + "/csv"),
               std::make_shared<trainer::TensorBoardLogger>(tmp.path, "tb")};
  trainer::Trainer t(o);
  Reg m;
  t.fit(m, regression_data(16), regression_data(4));
  EXPECT_EQ(t.log_dir(), tmp.path + "/csv");
  const auto csv = losses_of(read_csv(tmp.path + "/csv/metrics.csv"));
  EXPECT_EQ(csv.size(), 3u);
  ASSERT_FALSE(event_files(tmp.path + "/tb/version_0").empty()) << "no TensorBoard event file";
  expect_tensorboard_matches_csv(scalars_in(tmp.path + "/tb/version_0"), "train_loss", csv);
  EXPECT_FALSE(fs::exists(tmp.path + "/lightning_logs"));  // no default CsvLogger when loggers are given
}
