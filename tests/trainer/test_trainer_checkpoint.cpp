// Trainer checkpoints on one process: ModelCheckpoint top-k bookkeeping, ckpt_path "last",
// and exact resume (schedulers, dropout's RNG state, accumulation, pending validation).
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <functional>

#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/distributed/communicator.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/trainer.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

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

// A checkpoint with only the model, the optimizer and global_step (what
// tessera_ckpt.dcp.TrainerState writes from PyTorch, or Fabric::save of those three), cut
// here out of a Trainer checkpoint taken mid-epoch: fit resumes it at that step, with the
// data position (epoch, batch) and LR schedule of an uninterrupted run there, so every later
// loss and learning rate is that run's; it says what it derived.
TEST(TrainerResume, FromACheckpointWithoutLoopState) {
  auto opts = [&](const std::string& root, int64_t steps) {
    auto o = local_options(root);
    o.max_steps = steps;
    o.batch_size = 2;  // 10 samples: 5 steps per epoch
    o.callbacks.push_back(std::make_shared<trainer::LearningRateMonitor>());
    return o;
  };
  auto module = [] {
    Reg m;
    m.momentum = 0.9;
    m.sched = "step";
    return m;
  };
  TempDir a, b;
  trainer::Trainer full(opts(a.path, 9));
  Reg m = module();
  full.fit(m, regression_data(10), regression_data(6));
  const Csv want = read_csv(full.log_dir() + "/metrics.csv");
  ASSERT_EQ(losses_of(want).size(), 9u);
  {
    trainer::Trainer t(opts(b.path, 6));  // epoch 1, after its first step
    Reg m1 = module();
    t.fit(m1, regression_data(10), regression_data(6));
  }
  const std::string from = b.path + "/checkpoints/last.ckpt", cut = b.path + "/model-optimizer-step.ckpt";
  {
    const checkpoint::CheckpointMetadata meta = checkpoint::open_checkpoint(from);
    state::StateDict sd;
    for (const auto& [k, e] : meta.entries) {
      if (k != "global_step" && k.rfind("model.", 0) != 0 && k.rfind("optimizer_0.", 0) != 0) continue;
      if (e.is_tensor()) sd.set(k, at::empty(e.shape, at::TensorOptions().dtype(e.dtype)));
      else sd.set(k, e.value);
    }
    size_t moments = 0;
    for (const auto& k : sd.keys()) moments += k.rfind("optimizer_0.state.", 0) == 0;
    ASSERT_EQ(moments, 4u) << "the momentum buffers of the 4 parameters";
    checkpoint::LoadOptions only_these;
    only_these.strict = false;  // the RNG states and the rest stay behind
    const checkpoint::LoadResult res = checkpoint::load_local(sd, from, only_these);
    ASSERT_TRUE(res.missing.empty() && res.mismatched.empty());
    auto comm = distributed::Communicator::create(distributed::World{});
    checkpoint::save(sd, cut, *comm, {checkpoint::SaveMode::Full});
  }
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  trainer::Trainer t(opts(b.path + "/resumed", 9));
  Reg m2 = module();
  t.fit(m2, regression_data(10), regression_data(6), cut);
  const std::string said = ::testing::internal::GetCapturedStdout() + ::testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("has no Trainer loop state"), std::string::npos) << said;
  EXPECT_NE(said.find("resuming at step 6 (epoch 1, batch 1 of 5)"), std::string::npos) << said;
  const Csv got = read_csv(t.log_dir() + "/metrics.csv");
  EXPECT_EQ(losses_of(got).count(6), 0u);
  expect_same(losses_of(got), losses_of(want), 7, "train_loss after a resume from model, optimizer and step");
  expect_same(column_of(got, "lr-SGD"), column_of(want, "lr-SGD"), 7, "lr after a resume from model, optimizer and step");
  auto p1 = params_of(m), p2 = params_of(m2);
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(at::allclose(p1[i], p2[i], 1e-5, 1e-7));

  // Gradient accumulation: the position does not follow from the step alone; refused,
  // naming the option.
  auto acc = opts(b.path + "/acc", 9);
  acc.accumulate_grad_batches = 2;
  trainer::Trainer ta(acc);
  Reg m3 = module();
  try {
    ta.fit(m3, regression_data(10), regression_data(6), cut);
    ADD_FAILURE() << "resumed with accumulate_grad_batches 2";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("accumulate_grad_batches"), std::string::npos) << e.what();
  }
}
