// ProgressBar in terminal and plain mode with an injected clock: in-place redraws, width
// and redraw rate, rate-limited plain lines, disabled output, nested stages.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <sstream>
#include <string>

#include "trainer/trainer_test_util.h"
#include "support/test_util.h"
#include "tessera/trainer/progress_bar.h"

using namespace tessera;
using namespace tessera::testing;

namespace {
struct FakeClock {
  double t = 100;
  std::function<double()> fn() {
    return [this] { return t; };
  }
};
}  // namespace

TEST(ProgressBar, TerminalRedrawsInPlace) {
  FakeClock clk;
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.tty = true;
  o.clock = clk.fn();
  trainer::ProgressBar bar(o, &out);
  EXPECT_TRUE(bar.tty());
  bar.start("train", 2, 10, 100);
  for (int b = 0; b < 4; ++b) {
    clk.t += 0.5;  // 2 it/s
    bar.update(b, 20 + b + 1, {{"loss", b == 0 ? 123.456 : 0.5}, {"val_acc", 0.875}});
  }
  const std::string s = out.str();
  EXPECT_EQ(s.find('\n'), std::string::npos) << s;  // no newline until finish
  const auto draws = std::count(s.begin(), s.end(), '\r');
  EXPECT_EQ(draws, 5) << s;  // start + 4 batches
  const std::string last = s.substr(s.rfind('\r') + 1);
  EXPECT_CONTAINS(last, "train epoch 2: 4/10 [step 24/100]");
  EXPECT_CONTAINS(last, "2.0 it/s");
  EXPECT_CONTAINS(last, "ETA 0:03");  // 6 batches left at 2 it/s
  EXPECT_CONTAINS(last, "loss=0.5");
  EXPECT_CONTAINS(last, "val_acc=0.875");
  // The first line showed loss=123.5 (longer); the shorter next one blanks its tail.
  const size_t first_batch = s.find('\r', 1);
  const size_t second_batch = s.find('\r', first_batch + 1);
  const std::string line1 = s.substr(first_batch + 1, second_batch - first_batch - 1);
  const std::string line2 = s.substr(second_batch + 1, s.find('\r', second_batch + 1) - second_batch - 1);
  EXPECT_CONTAINS(line1, "loss=123.5");
  EXPECT_EQ(line2.size(), line1.size());
  EXPECT_EQ(line2.back(), ' ');
  bar.finish();
  EXPECT_EQ(out.str().back(), '\n');
  EXPECT_CONTAINS(out.str().substr(s.size()), "4/10");
}

TEST(ProgressBar, TerminalWidthAndRedrawRate) {
  FakeClock clk;
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.tty = true;
  o.clock = clk.fn();
  o.width = 30;
  o.refresh_rate = 2;
  trainer::ProgressBar bar(o, &out);
  bar.start("validate", 0, 7);
  for (int b = 0; b < 7; ++b) {
    clk.t += 0.2;
    bar.update(b, 5, {{"val_loss", 0.25}});
  }
  const std::string s = out.str();
  // start, batches 2, 4, 6 (refresh_rate) and 7 (the last)
  EXPECT_EQ(std::count(s.begin(), s.end(), '\r'), 5) << s;
  for (size_t p = 1, q; p < s.size(); p = q + 1) {  // every drawn line fits the width
    q = s.find('\r', p);
    if (q == std::string::npos) q = s.size();
    EXPECT_LE(q - p, 30u);
  }
  EXPECT_CONTAINS(s, "validate: 7/7");
  EXPECT_EQ(s.find("epoch"), std::string::npos);  // epochs and steps are the train stage's
}

TEST(ProgressBar, PlainLinesAreRateLimited) {
  FakeClock clk;
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.tty = false;
  o.clock = clk.fn();
  trainer::ProgressBar bar(o, &out);
  bar.start("train", 0, 40, -1);
  for (int b = 0; b < 40; ++b) {
    clk.t += 0.25;  // 4 it/s: at most one line a second, so every 4th batch
    bar.update(b, b + 1, {{"loss", 1.0 / (b + 1)}});
  }
  bar.finish();
  const std::string s = out.str();
  EXPECT_EQ(s.find('\r'), std::string::npos);
  ASSERT_EQ(s.back(), '\n');
  auto lines = lines_of(s);
  ASSERT_EQ(lines.size(), 11u) << s;  // 10 progress lines + the summary
  EXPECT_CONTAINS(lines[0], "train epoch 0: 4/40 [step 4]");
  EXPECT_CONTAINS(lines[0], "4.0 it/s");
  EXPECT_CONTAINS(lines[0], "ETA 0:09");
  EXPECT_CONTAINS(lines[0], "loss=0.25");
  EXPECT_CONTAINS(lines[10], "40/40");
  EXPECT_CONTAINS(lines[10], "0:10");  // elapsed
  EXPECT_EQ(lines[10].find("ETA"), std::string::npos);

  // refresh_rate counts batches; unknown total: ETA from max_steps at the step rate.
  std::ostringstream out2;
  o.refresh_rate = 10;
  trainer::ProgressBar bar2(o, &out2);
  bar2.start("train", 1, -1, 100);
  for (int b = 0; b < 20; ++b) {
    clk.t += 1;  // slow enough for every refresh
    bar2.update(b, 40 + b + 1, {});
  }
  auto lines2 = lines_of(out2.str());
  ASSERT_EQ(lines2.size(), 2u) << out2.str();
  EXPECT_CONTAINS(lines2[0], "train epoch 1: 10 [step 50/100]");
  EXPECT_CONTAINS(lines2[0], "1.0 it/s");
  EXPECT_CONTAINS(lines2[0], "ETA 0:50");  // 50 steps left at 1 step/s
  EXPECT_CONTAINS(lines2[1], "ETA 0:40");
}

TEST(ProgressBar, DisabledPrintsNothing) {
  std::ostringstream out;
  trainer::ProgressBarOptions o;
  o.enabled = false;
  trainer::ProgressBar bar(o, &out);
  bar.start("train", 0, 3);
  bar.update(0, 1, {{"loss", 1}});
  bar.finish();
  EXPECT_EQ(out.str(), "");
  o.enabled = true;
  o.refresh_rate = 0;
  EXPECT_CONTAINS(error_of([&] { trainer::ProgressBar bad(o, &out); }), "refresh_rate must be >= 1");
}

TEST(ProgressBar, NestedStageSuspendsAndResumesTheOuterOne) {
  FakeClock clk;
  for (bool tty : {true, false}) {
    SCOPED_TRACE(tty ? "tty" : "plain");
    std::ostringstream out;
    trainer::ProgressBarOptions o;
    o.tty = tty;
    o.clock = clk.fn();
    trainer::ProgressBar bar(o, &out);
    bar.start("train", 0, 4);
    clk.t += 2;
    bar.update(0, 1, {{"loss", 1}});
    clk.t += 2;
    bar.update(1, 2, {{"loss", 0.5}});
    bar.start("validate", 0, 2);  // validation in the middle of the epoch
    clk.t += 2;
    bar.update(0, 2, {});
    clk.t += 2;
    bar.update(1, 2, {});
    bar.finish();
    clk.t += 2;
    bar.update(2, 3, {{"loss", 0.25}});  // the train bar goes on
    clk.t += 2;
    bar.update(3, 4, {{"loss", 0.125}});
    bar.finish();
    const std::string s = out.str();
    EXPECT_CONTAINS(s, "train epoch 0: 2/4 [step 2]");
    EXPECT_CONTAINS(s, "validate: 2/2");
    EXPECT_CONTAINS(s, "train epoch 0: 4/4 [step 4]");
    EXPECT_CONTAINS(s, "loss=0.125");
    // train's last line comes after validate's, on a line of its own
    EXPECT_GT(s.rfind("train epoch 0: 4/4"), s.rfind("validate: 2/2"));
    const size_t v = s.rfind("validate: 2/2");
    EXPECT_NE(s.find('\n', v), std::string::npos);
    EXPECT_EQ(s.back(), '\n');
  }
}
