// Trainer configuration errors: bad TrainerOptions, callback and scheduler settings are
// refused with a message naming them, at construction or when fit starts.
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <functional>

#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/csv_logger.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;

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
