// `gpt train --resume auto` (issue 34, item 2): a job restarted with the same command line
// continues from the newest checkpoint in OUT/checkpoints that verifies, or starts fresh
// when there is none (also over an earlier run's metrics.csv and hparams.yaml, left by a
// job that failed before its first checkpoint); a corrupted newest checkpoint is skipped
// with a message naming it, not loaded and not changed. A fresh start keeps the earlier
// attempt's metrics.csv as OUT/metrics.earlier-<time>.csv (issue 44, item 8: it was
// replaced, and the rows of the steps before the damaged checkpoint were lost).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "examples/gpt_test_util.h"
#include "support/test_util.h"

namespace fs = std::filesystem;
using tessera::testing::kNoLauncherEnv;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;
using tessera::testing::gpt::kGpt;
using tessera::testing::gpt::train_losses;

namespace {

const std::string kArgs = " --strategy single --batch-size 8 --lr 3e-3 --seed 5 --log-every 1 --threads 1 "
                          "--no-progress-bar --val-every 0 --limit-val-batches 1 --n-layer 2 --n-head 2 --d-model 32 "
                          "--seq-len 16 --resume auto";

struct AutoRun {
  std::string dir, data, out, ckpts;
  AutoRun() : dir(temp_dir("tessera-gpt-auto")) {
    data = dir + "/text.txt";
    out = dir + "/run";
    ckpts = out + "/checkpoints";
    std::ostringstream s;
    for (int i = 0; i < 600; ++i) s << (i % 3 ? "shard tensor " : "rank gather.\n");
    write_bytes(data, s.str());
  }
  // The same command line every time but for --max-steps (what a restarted job reruns).
  std::pair<int, std::string> train(int64_t max_steps) const {
    return run_command(kNoLauncherEnv + kGpt + " train --data " + data + " --out " + out + " --max-steps " +
                       std::to_string(max_steps) + kArgs);
  }
};

// Every file under `path` (a file or a directory): relative path -> bytes.
std::map<std::string, std::string> files_of(const std::string& path) {
  std::map<std::string, std::string> m;
  if (!fs::is_directory(path)) {
    m[""] = read_bytes(path);
    return m;
  }
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file()) m[fs::relative(e.path(), path).string()] = read_bytes(e.path().string());
  return m;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// The files OUT/metrics.earlier-*.csv.
std::vector<std::string> earlier_metrics(const std::string& out) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("metrics.earlier-", 0) == 0 && n.size() > 4 && n.compare(n.size() - 4, 4, ".csv") == 0)
      v.push_back(e.path().string());
  }
  return v;
}

// Flips one byte near the end of the tensor data of the checkpoint `last` (a consolidated
// file, or the last data file of a sharded directory): damage only the checksums can tell.
void corrupt_tensor_bytes(const std::string& last) {
  std::string file = last;
  if (fs::is_directory(last))
    for (const auto& e : fs::directory_iterator(last))
      if (e.path().extension() == ".safetensors") file = e.path().string();
  std::string bytes = read_bytes(file);
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() - 9] = static_cast<char>(bytes[bytes.size() - 9] ^ 0x5a);
  write_bytes(file, bytes);
}

}  // namespace

class GptResumeAuto : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  }
};

TEST_F(GptResumeAuto, FreshThenResumesThenSkipsACorruptedNewest) {
  AutoRun r;
  // An earlier attempt that failed before its first checkpoint: metrics.csv and
  // hparams.yaml but no checkpoints/. auto starts fresh over it (a new run would refuse).
  fs::create_directories(r.out);
  write_bytes(r.out + "/metrics.csv", "step,epoch,train_loss\n1,0,5.5\n");
  write_bytes(r.out + "/hparams.yaml", "n_layer: 2\n");
  auto [rc1, o1] = r.train(2);
  ASSERT_EQ(rc1, 0) << o1;
  EXPECT_TRUE(has(o1, "gpt: no checkpoint that verifies in " + r.ckpts + ": starting fresh")) << o1;
  EXPECT_TRUE(has(o1, "steps_this_run=2")) << o1;
  const auto first = train_losses(r.out + "/metrics.csv");
  ASSERT_EQ(first.size(), 2u) << read_bytes(r.out + "/metrics.csv");
  EXPECT_EQ(first.begin()->first, 1);
  EXPECT_NE(first.at(1), 5.5);  // the earlier attempt's row is not in this run's file,
  // but kept beside it, byte for byte, and named.
  const auto kept = earlier_metrics(r.out);
  ASSERT_EQ(kept.size(), 1u) << o1;
  EXPECT_EQ(read_bytes(kept[0]), "step,epoch,train_loss\n1,0,5.5\n");
  EXPECT_TRUE(has(o1, "gpt: starting fresh: the earlier attempt's metrics.csv is kept as " + kept[0])) << o1;
  ASSERT_TRUE(fs::exists(r.ckpts + "/last.ckpt"));

  // The same command again: the checkpoint is at --max-steps, nothing to do (exit 0).
  auto [rc2, o2] = r.train(2);
  ASSERT_EQ(rc2, 0) << o2;
  EXPECT_TRUE(has(o2, "gpt: resuming from " + r.ckpts + "/last.ckpt (step 2)")) << o2;
  EXPECT_TRUE(has(o2, "gpt: nothing left to do")) << o2;

  // Further: resumes at step 2 and keeps the earlier rows.
  fs::copy(r.ckpts + "/last.ckpt", r.ckpts + "/step2.ckpt", fs::copy_options::recursive);
  auto [rc3, o3] = r.train(4);
  ASSERT_EQ(rc3, 0) << o3;
  EXPECT_TRUE(has(o3, "gpt: resuming from " + r.ckpts + "/last.ckpt (step 2)") ||
              has(o3, "gpt: resuming from " + r.ckpts + "/step2.ckpt (step 2)")) << o3;
  EXPECT_TRUE(has(o3, "gpt: done step=4 steps_this_run=2")) << o3;
  const auto resumed = train_losses(r.out + "/metrics.csv");
  ASSERT_EQ(resumed.size(), 4u) << read_bytes(r.out + "/metrics.csv");
  EXPECT_EQ(resumed.at(1), first.at(1));
  EXPECT_EQ(resumed.at(2), first.at(2));

  // last.ckpt (step 4) corrupted: a flipped byte in its tensor data. auto skips it,
  // naming it and the problem, sets it aside (last.ckpt.unverified-<time>, bytes as they
  // were: this run's save of last.ckpt would replace it) and takes step2.ckpt.
  const std::string last = r.ckpts + "/last.ckpt";
  corrupt_tensor_bytes(last);
  // A save's leftover temporary is no candidate.
  fs::create_directories(r.ckpts + "/.last.ckpt.tessera-tmp-99999-0");
  const auto corrupted = files_of(last);
  auto [rc4, o4] = r.train(2);
  ASSERT_EQ(rc4, 0) << o4;
  EXPECT_TRUE(has(o4, "gpt: skipping " + last + ": ")) << o4;
  EXPECT_TRUE(has(o4, "checksum mismatch")) << o4;
  EXPECT_TRUE(has(o4, "gpt: resuming from " + r.ckpts + "/step2.ckpt (step 2)")) << o4;
  EXPECT_TRUE(has(o4, "gpt: nothing left to do")) << o4;
  EXPECT_FALSE(has(o4, "tessera-tmp")) << o4;
  EXPECT_TRUE(has(o4, "; set aside as " + last + ".unverified-")) << o4;
  std::string aside;
  for (const auto& e : fs::directory_iterator(r.ckpts))
    if (e.path().filename().string().rfind("last.ckpt.unverified-", 0) == 0) aside = e.path().string();
  ASSERT_FALSE(aside.empty()) << o4;
  EXPECT_FALSE(fs::exists(last));
  EXPECT_TRUE(files_of(aside) == corrupted) << "auto changed the corrupted checkpoint";

  // Training on from step2.ckpt: step 3 again, bit for bit as the first time; the
  // set-aside checkpoint is no candidate any more, and this run's last.ckpt leaves it be.
  auto [rc5, o5] = r.train(3);
  ASSERT_EQ(rc5, 0) << o5;
  EXPECT_FALSE(has(o5, "gpt: skipping")) << o5;
  EXPECT_TRUE(has(o5, "gpt: resuming from " + r.ckpts + "/step2.ckpt (step 2)")) << o5;
  EXPECT_TRUE(files_of(aside) == corrupted);
  EXPECT_TRUE(has(o5, "gpt: done step=3 steps_this_run=1")) << o5;
  const auto again = train_losses(r.out + "/metrics.csv");
  ASSERT_EQ(again.size(), 3u) << read_bytes(r.out + "/metrics.csv");
  EXPECT_EQ(again.at(3), resumed.at(3));
}

// The case: the only checkpoint (step 4) is damaged, so the restarted job starts
// fresh; the earlier attempt's rows (steps 1-4) used to be lost with its metrics.csv. Now
// that file is kept as OUT/metrics.earlier-<time>.csv byte for byte, the new metrics.csv
// holds this run's steps once each (no row of the earlier attempt mixed in), and a second
// fresh start keeps both earlier files under free names.
TEST_F(GptResumeAuto, FreshStartKeepsTheEarlierAttemptsMetrics) {
  AutoRun r;
  auto [rc1, o1] = r.train(4);
  ASSERT_EQ(rc1, 0) << o1;
  const std::string metrics = r.out + "/metrics.csv";
  const std::string earlier = read_bytes(metrics);
  ASSERT_EQ(train_losses(metrics).size(), 4u) << earlier;
  EXPECT_TRUE(earlier_metrics(r.out).empty());  // nothing to keep at the first start

  auto corrupt_last = [&] { corrupt_tensor_bytes(r.ckpts + "/last.ckpt"); };
  corrupt_last();
  auto [rc2, o2] = r.train(2);
  ASSERT_EQ(rc2, 0) << o2;
  EXPECT_TRUE(has(o2, "; set aside as " + r.ckpts + "/last.ckpt.unverified-")) << o2;
  EXPECT_TRUE(has(o2, "starting fresh")) << o2;
  EXPECT_TRUE(has(o2, "gpt: done step=2 steps_this_run=2")) << o2;
  const auto kept = earlier_metrics(r.out);
  ASSERT_EQ(kept.size(), 1u) << o2;
  EXPECT_EQ(read_bytes(kept[0]), earlier);  // steps 1-4 of the earlier attempt, as written
  EXPECT_TRUE(has(o2, "gpt: starting fresh: the earlier attempt's metrics.csv is kept as " + kept[0])) << o2;
  const auto fresh = train_losses(metrics);
  ASSERT_EQ(fresh.size(), 2u) << read_bytes(metrics);  // this run's steps 1 and 2, once each
  EXPECT_EQ(fresh.begin()->first, 1);
  EXPECT_EQ(fresh.rbegin()->first, 2);

  // Again: the second attempt's file is kept too, under another name; the first stays.
  corrupt_last();
  auto [rc3, o3] = r.train(2);
  ASSERT_EQ(rc3, 0) << o3;
  const auto kept2 = earlier_metrics(r.out);
  ASSERT_EQ(kept2.size(), 2u) << o3;
  std::vector<std::string> contents;
  for (const auto& k : kept2) contents.push_back(read_bytes(k));
  EXPECT_TRUE((contents[0] == earlier) != (contents[1] == earlier)) << "the first kept file changed or was copied";
  EXPECT_EQ(train_losses(metrics).size(), 2u) << read_bytes(metrics);
}
