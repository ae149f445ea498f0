// The progress bar's ETA in training: the stage ends at the epoch's last batch or at
// max_steps, whichever comes first (a short run inside a long epoch must not show the
// epoch's remaining time). Plain-mode lines with an injected clock.
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "tessera/trainer/progress_bar.h"
#include "support/test_util.h"

using namespace tessera;

namespace {
// The text after "ETA " on the last line written.
std::string last_eta(const std::string& out) {
  const size_t p = out.rfind("ETA ");
  if (p == std::string::npos) return "";
  return out.substr(p + 4, out.find_first_of(" \n", p + 4) - p - 4);
}
}  // namespace

TEST(ProgressBarEta, TrainingStopsAtMaxStepsBeforeTheEpochEnds) {
  double now = 50;
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.tty = false;
  o.clock = [&] { return now; };
  trainer::ProgressBar bar(o, &out);
  // 1000 batches in the epoch, but the run stops at step 20; one batch (= one step) a second.
  bar.start("train", 0, 1000, 20);
  for (int b = 0; b < 10; ++b) {
    now += 1;
    bar.update(b, b + 1, {});
  }
  EXPECT_CONTAINS(out.str(), "[step 10/20]");
  EXPECT_EQ(last_eta(out.str()), "0:10") << out.str();  // 10 steps left, not 990 batches

  // The epoch ends first (max_steps far away): the batches left decide.
  std::ostringstream out2;
  trainer::ProgressBar bar2(o, &out2);
  bar2.start("train", 1, 30, 5000);
  for (int b = 0; b < 10; ++b) {
    now += 1;
    bar2.update(b, 100 + b + 1, {});
  }
  EXPECT_EQ(last_eta(out2.str()), "0:20") << out2.str();

  // Gradient accumulation: 2 batches per step at 1 batch/s. After 10 batches at step 5
  // (4 steps in the 9 s since the first one): 5 steps left = 11 s, sooner than the 90
  // batches left in the epoch.
  std::ostringstream out3;
  trainer::ProgressBar bar3(o, &out3);
  bar3.start("train", 0, 100, 10);
  for (int b = 0; b < 10; ++b) {
    now += 1;
    bar3.update(b, (b + 2) / 2, {});
  }
  EXPECT_CONTAINS(out3.str(), "[step 5/10]");
  EXPECT_EQ(last_eta(out3.str()), "0:11") << out3.str();
}

// Evaluation stages have no step limit: their ETA stays the batches left.
TEST(ProgressBarEta, ValidationIgnoresMaxSteps) {
  double now = 0;
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.tty = false;
  o.clock = [&] { return now; };
  trainer::ProgressBar bar(o, &out);
  bar.start("validate", 0, 10, 3);
  for (int b = 0; b < 4; ++b) {
    now += 1;
    bar.update(b, 3, {});
  }
  EXPECT_EQ(last_eta(out.str()), "0:06") << out.str();
}
