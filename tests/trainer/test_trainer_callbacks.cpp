// Trainer callbacks on one process: EarlyStopping, a user callback's hooks and state,
// and the stage callbacks see.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;

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
