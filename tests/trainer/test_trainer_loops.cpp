// Trainer loops on one process: validation / test loops and their metrics, batch limits,
// gradient accumulation and clipping, LR schedulers (and their resume), ModelCheckpoint
// top-k bookkeeping, EarlyStopping, LearningRateMonitor, ckpt_path "last", exact resume
// with dropout, and configuration errors.
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <filesystem>
#include <functional>

#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/tensorboard_logger.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

struct Reg : trainer::TrainingModule {
  torch::nn::Sequential net;
  double lr = 0.1, momentum = 0.0, dropout = 0.0;
  std::string sched;           // "", "step", "epoch"
  std::vector<double> scores;  // scripted validation "score" per epoch
  int validations = 0, val_batches = 0, test_batches = 0, epoch_starts = 0;

  torch::nn::AnyModule configure_model() override {
    at::manual_seed(9);
    net = torch::nn::Sequential(torch::nn::Linear(3, 6), torch::nn::Tanh(), torch::nn::Dropout(dropout),
                                torch::nn::Linear(6, 1));
    return torch::nn::AnyModule(strategy::WrappedModule(net));
  }
  trainer::OptimizerConfig configure_optimizers() override {
    auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
    if (sched == "step") return {opt, std::make_shared<trainer::StepLR>(opt, 2, 0.5)};
    if (sched == "epoch") return {opt, std::make_shared<trainer::LambdaLR>(opt, [](int64_t e) { return 1.0 / (1 + e); }),
                                trainer::Interval::Epoch};
    return opt;
  }
  at::Tensor mse(const trainer::Batch& b) { return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean(); }
  at::Tensor training_step(const trainer::Batch& b, int64_t) override { return mse(b); }
  void validation_step(const trainer::Batch& b, int64_t) override {
    ++val_batches;
    if (!scores.empty()) log("score", scores.at(static_cast<size_t>(current_epoch())));
    else log("val_loss", mse(b), /*prog_bar=*/true, /*sync_dist=*/true);
  }
  void test_step(const trainer::Batch& b, int64_t) override {
    ++test_batches;
    log("test_loss", mse(b));
  }
  void on_validation_end() override { ++validations; }
  void on_train_epoch_start(int64_t) override { ++epoch_starts; }
};

// The mean squared error of the module's model over every sample of `d`.
double full_mse(Reg& m, const trainer::TensorData& d) {
  at::NoGradGuard ng;
  m.net->eval();
  const double v = (m.net->forward(d.inputs) - d.targets).pow(2).mean().item<double>();
  m.net->train();
  return v;
}

std::vector<at::Tensor> params_of(Reg& m) {
  std::vector<at::Tensor> out;
  for (auto& p : m.net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

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

// Stopped mid-epoch, mid-schedule, with momentum, dropout (the RNG state) and
// accumulation, then resumed: the same losses and learning rates as one run.
TEST(TrainerResume, SchedulerDropoutAndAccumulationResumeExactly) {
  for (const std::string sched : {"step", "epoch"}) {
    auto opts = [&](const std::string& root, int64_t steps) {
      auto o = local_options(root);
      o.max_steps = steps;
      o.batch_size = 2;
      o.accumulate_grad_batches = 2;  // 10 samples: 5 batches -> 3 steps per epoch (the last of one batch)
      o.callbacks.push_back(std::make_shared<trainer::LearningRateMonitor>());
      return o;
    };
    auto module = [&] {
      Reg m;
      m.momentum = 0.9;
      m.dropout = 0.3;
      m.sched = sched;
      return m;
    };
    TempDir a, b;
    trainer::Trainer full(opts(a.path, 8));
    Reg m = module();
    full.fit(m, regression_data(10), regression_data(6));
    const Csv want = read_csv(full.log_dir() + "/metrics.csv");
    ASSERT_EQ(losses_of(want).size(), 8u);
    {
      trainer::Trainer t(opts(b.path, 4));  // epoch 1, after its first step
      Reg m1 = module();
      t.fit(m1, regression_data(10), regression_data(6));
    }
    trainer::Trainer t(opts(b.path, 8));
    Reg m2 = module();
    t.fit(m2, regression_data(10), regression_data(6), "last");
    const Csv got = read_csv(t.log_dir() + "/metrics.csv");
    expect_same(losses_of(got), losses_of(want), 5, sched + " resume: train_loss");
    expect_same(column_of(got, "lr-SGD"), column_of(want, "lr-SGD"), 5, sched + " resume: lr");
    auto p1 = params_of(m), p2 = params_of(m2);
    for (size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(at::allclose(p1[i], p2[i], 1e-5, 1e-7)) << sched;
    if (sched == "step") EXPECT_DOUBLE_EQ(column_of(want, "lr-SGD").at(8), 0.1 * 0.125);  // count 7: 0.5^3
  }
}

namespace {

// A Trainer with one ModelCheckpoint that monitors "score" and keeps the best k; `tweak`
// changes the callback's options further (mode, file name, ...).
trainer::TrainerOptions topk_options(const std::string& root, int64_t epochs, int64_t k, bool sharded,
                                     bool async = false,
                                     const std::function<void(trainer::ModelCheckpointOptions&)>& tweak = nullptr) {
  auto o = local_options(root);
  o.max_epochs = epochs;
  o.limit_train_batches = 1;
  if (sharded) o.fabric.state_dict_type = strategy::StateDictType::Sharded;
  trainer::ModelCheckpointOptions mo;
  mo.monitor = "score";
  mo.save_top_k = k;
  mo.save_last = true;
  mo.filename = "{epoch}-{step}-{score:.3f}";
  mo.async_save = async;
  if (tweak) tweak(mo);
  o.callbacks.push_back(std::make_shared<trainer::ModelCheckpoint>(mo));
  return o;
}

}  // namespace

TEST(TrainerCheckpoint, TopKFilesMatchTheBookkeeping) {
  const std::vector<double> scores = {5, 3, 4, 1, 2, 6};
  // async: each save is written in the background; superseded checkpoints go once the
  // one replacing them is committed, and fit returns with everything committed.
  for (auto [sharded, async] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    SCOPED_TRACE(std::string(sharded ? "sharded" : "full") + (async ? " async" : ""));
    TempDir tmp;
    trainer::Trainer t(topk_options(tmp.path, 6, 2, sharded, async));
    Reg m;
    m.scores = scores;
    t.fit(m, regression_data(8), regression_data(4));
    auto mc = t.checkpoint_callback();
    ASSERT_TRUE(mc);
    const std::string dir = tmp.path + "/checkpoints";
    EXPECT_EQ(entries(dir), (std::vector<std::string>{"epoch=3-step=4-score=1.000.ckpt",
                                                      "epoch=4-step=5-score=2.000.ckpt", "last.ckpt"}));
    EXPECT_EQ(mc->best_model_path(), dir + "/epoch=3-step=4-score=1.000.ckpt");
    EXPECT_EQ(mc->best_model_score(), 1.0);
    EXPECT_EQ(mc->best_k_models().size(), 2u);
    for (auto& [p, s] : mc->best_k_models()) EXPECT_EQ(fs::is_directory(p), sharded) << p;
    EXPECT_EQ(t.last_checkpoint_path(), dir + "/last.ckpt");
    EXPECT_EQ(t.checkpoint_stats().saves, 6 + 5);  // last.ckpt every epoch, a top-k file in 5 of them
  }
  // save_top_k -1 keeps all; mode max keeps the largest.
  TempDir all;
  trainer::Trainer t(topk_options(all.path, 3, -1, false));
  Reg m;
  m.scores = scores;
  t.fit(m, regression_data(8), regression_data(4));
  EXPECT_EQ(entries(all.path + "/checkpoints").size(), 4u);
  for (bool async : {false, true}) {
    TempDir mx;
    trainer::Trainer t2(topk_options(mx.path, 4, 1, false, async, [](trainer::ModelCheckpointOptions& mo) {
      mo.mode = "max";
      mo.filename = "best";
      mo.save_last = false;
    }));
    Reg m2;
    m2.scores = {1, 7, 3, 7};
    t2.fit(m2, regression_data(8), regression_data(4));
    // The better score's file replaces the one it supersedes under the same name; 7 again is not better.
    EXPECT_EQ(entries(mx.path + "/checkpoints"), (std::vector<std::string>{"best.ckpt"}));
    EXPECT_EQ(t2.checkpoint_callback()->best_model_score(), 7.0);
  }
}

TEST(TrainerCheckpoint, ResumedRunContinuesTheTopK) {
  TempDir tmp;
  {
    trainer::Trainer t(topk_options(tmp.path, 3, 2, true));
    Reg m;
    m.scores = {5, 3, 4, 1, 2, 6};
    t.fit(m, regression_data(8), regression_data(4));
  }
  const std::string dir = tmp.path + "/checkpoints";
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"epoch=1-step=2-score=3.000.ckpt",
                                                    "epoch=2-step=3-score=4.000.ckpt", "last.ckpt"}));
  trainer::Trainer t(topk_options(tmp.path, 6, 2, true));
  Reg m;
  m.scores = {5, 3, 4, 1, 2, 6};
  t.fit(m, regression_data(8), regression_data(4), "last");
  EXPECT_EQ(entries(dir), (std::vector<std::string>{"epoch=3-step=4-score=1.000.ckpt",
                                                    "epoch=4-step=5-score=2.000.ckpt", "last.ckpt"}));
  EXPECT_EQ(m.epoch_starts, 3);  // epochs 3, 4, 5 only
}

TEST(TrainerCheckpoint, LastFindsTheNewestLastCheckpoint) {
  TempDir tmp;
  auto opts = [&](int64_t steps) {
    auto o = local_options(tmp.path);
    o.max_steps = steps;
    trainer::ModelCheckpointOptions a, b;
    a.dirpath = tmp.path + "/a";
    a.save_last = true;
    a.save_top_k = -1;
    a.every_n_train_steps = 2;
    b.dirpath = tmp.path + "/b";
    b.save_last = true;
    b.save_top_k = 0;
    b.every_n_train_steps = 3;
    o.callbacks = {std::make_shared<trainer::ModelCheckpoint>(a), std::make_shared<trainer::ModelCheckpoint>(b)};
    return o;
  };
  {
    trainer::Trainer t(opts(5));
    Reg m;
    t.fit(m, regression_data(40));
  }
  // a/last.ckpt becomes the (older) step-2 checkpoint: "last" must pick b/last.ckpt (step 5).
  fs::copy_file(tmp.path + "/a/epoch=0-step=2.ckpt", tmp.path + "/a/last.ckpt", fs::copy_options::overwrite_existing);
  fs::last_write_time(tmp.path + "/a/last.ckpt", fs::last_write_time(tmp.path + "/b/last.ckpt") - std::chrono::hours(1));
  trainer::Trainer t(opts(6));
  Reg m;
  t.fit(m, regression_data(40), "last");
  auto losses = losses_of(read_csv(t.log_dir() + "/metrics.csv"));
  ASSERT_EQ(losses.size(), 1u);
  EXPECT_EQ(losses.begin()->first, 6);
}

TEST(TrainerCallbacks, EarlyStoppingWithPatienceAndMinDelta) {
  TempDir tmp;
  auto o = local_options(tmp.path);
  o.max_epochs = 10;
  o.limit_train_batches = 1;
  trainer::EarlyStoppingOptions eo;
  eo.monitor = "score";
  eo.patience = 2;
  eo.min_delta = 0.5;
  auto es = std::make_shared<trainer::EarlyStopping>(eo);
  o.callbacks.push_back(es);
  trainer::Trainer t(o);
  Reg m;
  m.scores = {5, 4, 4.5, 3.6, 1, 1, 1, 1, 1, 1};  // 3.6 improves by 0.4 < min_delta: the 2nd miss
  t.fit(m, regression_data(8), regression_data(4));
  EXPECT_EQ(es->stopped_epoch(), 3);
  EXPECT_EQ(t.global_step(), 4);
  EXPECT_EQ(es->best_score(), 4.0);
  EXPECT_EQ(m.validations, 4);

  // The monitored metric never logged: an error naming it (strict).
  TempDir tmp2;
  auto o2 = local_options(tmp2.path);
  o2.max_epochs = 2;
  eo.monitor = "val_acc";
  o2.callbacks.push_back(std::make_shared<trainer::EarlyStopping>(eo));
  trainer::Trainer t2(o2);
  Reg m2;
  EXPECT_CONTAINS(error_of([&] { t2.fit(m2, regression_data(8), regression_data(4)); }), "'val_acc' was not logged");
}

TEST(TrainerCallbacks, UserCallbackSeesHooksInOrderAndKeepsState) {
  struct Recorder : trainer::Callback {
    std::vector<std::string> events;
    int64_t batches = 0;
    std::string state_key() const override { return "Recorder"; }
    state::StateDict state_dict() const override {
      state::StateDict sd;
      sd.set("batches", batches);
      return sd;
    }
    void load_state_dict(const state::StateDict& sd) override { batches = sd.integer("batches"); }
    void on_fit_start(trainer::Trainer&, trainer::TrainingModule&) override { events.push_back("fit_start"); }
    void on_train_epoch_start(trainer::Trainer& t, trainer::TrainingModule&) override {
      events.push_back("epoch_start " + std::to_string(t.current_epoch()));
    }
    void on_train_batch_end(trainer::Trainer& t, trainer::TrainingModule&, const at::Tensor&, const trainer::Batch&,
                            int64_t i) override {
      ++batches;
      events.push_back("batch_end " + std::to_string(i) + " step " + std::to_string(t.global_step()));
    }
    void on_validation_end(trainer::Trainer& t, trainer::TrainingModule&) override {
      events.push_back("validation_end " + std::to_string(t.callback_metrics().count("val_loss")));
    }
    void on_train_epoch_end(trainer::Trainer&, trainer::TrainingModule&) override { events.push_back("epoch_end"); }
    void on_fit_end(trainer::Trainer&, trainer::TrainingModule&) override { events.push_back("fit_end"); }
  };
  TempDir tmp;
  auto rec = std::make_shared<Recorder>();
  auto o = local_options(tmp.path);
  o.max_epochs = 1;
  o.callbacks.push_back(rec);
  trainer::Trainer t(o);
  Reg m;
  t.fit(m, regression_data(8), regression_data(4));
  EXPECT_EQ(rec->events, (std::vector<std::string>{"fit_start", "epoch_start 0", "batch_end 0 step 1",
                                                   "batch_end 1 step 2", "validation_end 1", "epoch_end", "fit_end"}));
  auto rec2 = std::make_shared<Recorder>();
  auto o2 = local_options(tmp.path);
  o2.max_epochs = 2;
  o2.callbacks.push_back(rec2);
  trainer::Trainer t2(o2);
  Reg m2;
  t2.fit(m2, regression_data(8), regression_data(4), "last");
  EXPECT_EQ(rec2->batches, 4);  // 2 restored + 2 in epoch 1
}

// setup / teardown get the stage that runs, Trainer::stage() is that stage inside it
// (validation in fit is part of fit) and Stage::None outside; to_string gives the
// words logs and messages print.
TEST(TrainerCallbacks, SeeTheRunningStage) {
  struct StageRecorder : trainer::Callback {
    std::vector<std::string> events;
    void setup(trainer::Trainer& t, trainer::TrainingModule&, trainer::Stage stage) override {
      events.push_back(std::string("setup ") + trainer::to_string(stage) + " " + trainer::to_string(t.stage()));
    }
    void teardown(trainer::Trainer&, trainer::TrainingModule&, trainer::Stage stage) override {
      events.push_back(std::string("teardown ") + trainer::to_string(stage));
    }
    void on_validation_end(trainer::Trainer& t, trainer::TrainingModule&) override {
      events.push_back(std::string("validation_end ") + trainer::to_string(t.stage()));
    }
    void on_test_end(trainer::Trainer& t, trainer::TrainingModule&) override {
      events.push_back(std::string("test_end ") + trainer::to_string(t.stage()));
    }
  };
  TempDir tmp;
  auto rec = std::make_shared<StageRecorder>();
  auto o = local_options(tmp.path);
  o.max_epochs = 1;
  o.callbacks.push_back(rec);
  trainer::Trainer t(o);
  Reg m;
  EXPECT_EQ(t.stage(), trainer::Stage::None);
  t.fit(m, regression_data(8), regression_data(4));
  EXPECT_EQ(t.stage(), trainer::Stage::None);
  t.validate(m, regression_data(4));
  t.test(m, regression_data(4));
  EXPECT_EQ(t.stage(), trainer::Stage::None);
  EXPECT_EQ(rec->events, (std::vector<std::string>{"setup fit fit", "validation_end fit", "teardown fit",
                                                   "setup validate validate", "validation_end validate",
                                                   "teardown validate", "setup test test", "test_end test",
                                                   "teardown test"}));
  EXPECT_STREQ(trainer::to_string(trainer::Stage::None), "none");
  EXPECT_STREQ(trainer::to_string(trainer::Interval::Step), "step");
  EXPECT_STREQ(trainer::to_string(trainer::Interval::Epoch), "epoch");
}

TEST(TrainerConfig, RefusesBadOptionsNamingThem) {
  TempDir tmp;
  auto expect_refused = [&](const std::function<void(trainer::TrainerOptions&)>& change, const std::string& part) {
    auto o = local_options(tmp.path);
    change(o);
    EXPECT_CONTAINS(error_of([&] { trainer::Trainer t(o); }), part);
  };
  using O = trainer::TrainerOptions;
  expect_refused([](O& o) { o.accumulate_grad_batches = 0; }, "TrainerOptions.accumulate_grad_batches");
  expect_refused([](O& o) { o.gradient_clip_algorithm = "l1"; }, "TrainerOptions.gradient_clip_algorithm");
  expect_refused([](O& o) { o.gradient_clip_val = -1.0; }, "TrainerOptions.gradient_clip_val");
  expect_refused([](O& o) { o.val_check_interval = 0; }, "TrainerOptions.val_check_interval");
  expect_refused([](O& o) { o.val_check_interval = 1.5; }, "TrainerOptions.val_check_interval");
  expect_refused([](O& o) { o.limit_val_batches = -1; }, "TrainerOptions.limit_val_batches");
  expect_refused([](O& o) { o.limit_train_batches = 2.0; }, "TrainerOptions.limit_train_batches");
  expect_refused([](O& o) { o.check_val_every_n_epoch = 0; }, "TrainerOptions.check_val_every_n_epoch");
  expect_refused([](O& o) { o.eval_batch_size = -2; }, "TrainerOptions.eval_batch_size");
  expect_refused([](O& o) { o.callbacks.push_back(nullptr); }, "TrainerOptions.callbacks[0] is null");
  expect_refused(
      [](O& o) {
        o.callbacks = {std::make_shared<trainer::EarlyStopping>(), std::make_shared<trainer::EarlyStopping>()};
      },
      "is used by another callback");
  expect_refused(
      [](O& o) {
        o.enable_checkpointing = false;
        o.callbacks = {std::make_shared<trainer::ModelCheckpoint>()};
      },
      "enable_checkpointing is false");
  expect_refused(
      [](O& o) {
        o.enable_logger = false;
        o.loggers = {std::make_shared<trainer::CsvLogger>(o.default_root_dir)};
      },
      "enable_logger is false");
  expect_refused([](O& o) { o.progress_bar.refresh_rate = 0; }, "TrainerOptions.progress_bar.refresh_rate");

  {
    auto o = local_options(tmp.path);
    o.deterministic = true;
    trainer::Trainer t(o);
    EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
    at::globalContext().setDeterministicAlgorithms(false, false);
  }

  trainer::ModelCheckpointOptions mo;
  mo.mode = "avg";
  EXPECT_CONTAINS(error_of([&] { trainer::ModelCheckpoint c(mo); }), "ModelCheckpoint.mode");
  mo = {};
  mo.save_top_k = 3;
  EXPECT_CONTAINS(error_of([&] { trainer::ModelCheckpoint c(mo); }), "needs ModelCheckpoint.monitor");
  mo = {};
  mo.filename = "{epoch:.2x}";
  EXPECT_CONTAINS(error_of([&] { trainer::ModelCheckpoint c(mo); }), "unsupported format '.2x'");
  trainer::EarlyStoppingOptions eo;
  eo.patience = -1;
  EXPECT_CONTAINS(error_of([&] { trainer::EarlyStopping c(eo); }), "EarlyStopping.patience");

  // Errors found when fit starts.
  auto o = local_options(tmp.path);
  o.val_check_interval = 10;  // more than the 3 training batches
  trainer::Trainer t(o);
  Reg m;
  EXPECT_CONTAINS(error_of([&] { t.fit(m, regression_data(10), regression_data(4)); }),
                  "TrainerOptions.val_check_interval (10 batches)");
  struct BadSched : Reg {
    trainer::OptimizerConfig configure_optimizers() override {
      auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
      // Neither Interval::Step nor Interval::Epoch (a value cast from an integer).
      return {opt, std::make_shared<trainer::StepLR>(opt, 1), static_cast<trainer::Interval>(7)};
    }
  };
  trainer::Trainer t2(local_options(tmp.path));
  BadSched bs;
  EXPECT_CONTAINS(error_of([&] { t2.fit(bs, regression_data(10)); }), "OptimizerConfig.schedulers[0].interval");
  struct NoVal : trainer::TrainingModule {
    torch::nn::Linear net{3, 1};
    torch::nn::AnyModule configure_model() override { return torch::nn::AnyModule(net); }
    trainer::OptimizerConfig configure_optimizers() override {
      return std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
    }
    at::Tensor training_step(const trainer::Batch& b, int64_t) override {
      return (model().forward<at::Tensor>(b.inputs) - b.targets).pow(2).mean();
    }
  };
  trainer::Trainer t3(local_options(tmp.path));
  NoVal nv;
  EXPECT_CONTAINS(error_of([&] { t3.fit(nv, regression_data(10), regression_data(4)); }),
                  "does not override validation_step");
}

// A checkpoint written at a step whose validation had not run yet (every_n_train_steps
// saves before the step's validation): the resumed run validates first, so its metrics
// and losses match the uninterrupted run.
TEST(TrainerResume, FromACheckpointSavedBeforeItsValidation) {
  TempDir tmp;
  auto opts = [&] {
    auto o = local_options(tmp.path);
    o.max_steps = 6;
    o.val_check_interval = 2;
    trainer::ModelCheckpointOptions mo;
    mo.every_n_train_steps = 2;
    mo.save_top_k = -1;
    o.callbacks = {std::make_shared<trainer::ModelCheckpoint>(mo)};
    return o;
  };
  trainer::Trainer full(opts());
  Reg m;
  m.momentum = 0.9;
  full.fit(m, regression_data(16), regression_data(6));
  const Csv want = read_csv(full.log_dir() + "/metrics.csv");
  ASSERT_EQ(column_of(want, "val_loss").size(), 3u);
  trainer::Trainer t(opts());
  Reg m2;
  m2.momentum = 0.9;
  t.fit(m2, regression_data(16), regression_data(6), tmp.path + "/checkpoints/epoch=0-step=2.ckpt");
  const Csv got = read_csv(t.log_dir() + "/metrics.csv");
  expect_same(column_of(got, "val_loss"), column_of(want, "val_loss"), 2, "validation after resume");
  expect_same(losses_of(got), losses_of(want), 3, "losses after resume");
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
