// Resuming by itself (issue 34, item 2): checkpoint::find_resumable takes the newest
// checkpoint that verifies (by stored global_step), skips torn, corrupted and unreadable
// ones with a message naming them and leaves them as they are (or sets them aside:
// Skipped::SetAside, the Trainer's choice), verifies in parts across ranks, ignores temporaries and
// what is not a checkpoint; the Trainer's ckpt_path "auto" starts fresh when there is
// none and resumes otherwise, at 1 and 2 ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/resume.h"
#include "tessera/trainer/callbacks.h"
#include "tessera/trainer/trainer.h"
#include "trainer/regression_module.h"
#include "trainer/trainer_test_util.h"

using namespace tessera;
using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

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

// Flips one byte near the end of the largest data file of the checkpoint at `path` (a
// consolidated file, or a sharded directory's largest file other than its metadata):
// tensor bytes that only the checksums can tell apart.
void corrupt(const std::string& path) {
  std::string file = path;
  if (fs::is_directory(path)) {
    uintmax_t best = 0;
    for (const auto& e : fs::directory_iterator(path))
      if (e.path().filename() != "tessera-checkpoint.json" && e.file_size() > best) {
        best = e.file_size();
        file = e.path().string();
      }
  }
  std::string bytes = read_bytes(file);
  ASSERT_GT(bytes.size(), 64u) << file;
  bytes[bytes.size() - 9] = static_cast<char>(bytes[bytes.size() - 9] ^ 0x5a);
  write_bytes(file, bytes);
}

// A fit to `steps` with checkpoints every 2 steps, all kept (epoch=0-step=N.ckpt), and
// last.ckpt.
trainer::TrainerOptions every_two(const std::string& root, int64_t steps, bool sharded) {
  auto o = local_options(root);
  o.max_steps = steps;
  if (sharded) o.fabric.state_dict_type = strategy::StateDictType::Sharded;
  trainer::ModelCheckpointOptions mo;
  mo.every_n_train_steps = 2;
  mo.save_top_k = -1;
  mo.save_last = true;
  o.callbacks = {std::make_shared<trainer::ModelCheckpoint>(mo)};
  return o;
}

bool any_line_has(const std::vector<std::string>& lines, const std::string& part) {
  return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.find(part) != std::string::npos; });
}

}  // namespace

TEST(ResumeAuto, NewestThatVerifiesWinsAndBadOnesAreSkippedAndKept) {
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded" : "consolidated");
    TempDir tmp;
    {
      trainer::Trainer t(every_two(tmp.path, 4, sharded));
      Reg m;
      t.fit(m, regression_data(40));
    }
    const std::string dir = tmp.path + "/checkpoints";
    ASSERT_EQ(entries(dir), (std::vector<std::string>{"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"}));
    const std::string s2 = dir + "/epoch=0-step=2.ckpt", s4 = dir + "/epoch=0-step=4.ckpt", last = dir + "/last.ckpt";
    EXPECT_EQ(fs::is_directory(last), sharded);

    std::vector<std::string> lines;
    auto collect = [&](const std::string& l) { lines.push_back(l); };
    checkpoint::ResumeChoice c = checkpoint::find_resumable({dir}, collect);
    EXPECT_EQ(c.global_step, 4);
    EXPECT_TRUE(c.path == last || c.path == s4) << c.path;
    EXPECT_TRUE(c.skipped.empty());
    ASSERT_EQ(lines.size(), 1u);
    EXPECT_EQ(lines[0], "resuming from " + c.path + " (step 4)");

    // Not candidates: a save's temporary (a whole, valid step-4 copy that would otherwise
    // win its tie), hidden files, and files that are not checkpoints.
    fs::copy(last, dir + "/.last.ckpt.tessera-tmp-12345-0", fs::copy_options::recursive);
    write_bytes(dir + "/notes.txt", "not a checkpoint\n");
    // A candidate whose metadata cannot be read: skipped with the reason.
    write_bytes(dir + "/broken.ckpt", "garbage, not a checkpoint");
    // Both step-4 checkpoints corrupted: the step-2 one is taken.
    corrupt(last);
    corrupt(s4);
    const auto last_before = files_of(last), s4_before = files_of(s4);
    lines.clear();
    c = checkpoint::find_resumable({dir, tmp.path + "/missing"}, collect);
    EXPECT_EQ(c.path, s2);
    EXPECT_EQ(c.global_step, 2);
    ASSERT_EQ(c.skipped.size(), 3u) << ::testing::PrintToString(c.skipped);
    EXPECT_EQ(c.skipped[0].rfind(dir + "/broken.ckpt: cannot read its metadata: ", 0), 0u) << c.skipped[0];
    // Newest first: the step-4 ones, each named with its problem (a checksum mismatch).
    const bool last_first = c.skipped[1].rfind(last + ": ", 0) == 0;
    EXPECT_EQ(c.skipped[last_first ? 1 : 2].rfind(last + ": ", 0), 0u) << c.skipped[1];
    EXPECT_EQ(c.skipped[last_first ? 2 : 1].rfind(s4 + ": ", 0), 0u) << c.skipped[2];
    for (size_t i : {1, 2}) EXPECT_NE(c.skipped[i].find("checksum mismatch"), std::string::npos) << c.skipped[i];
    ASSERT_EQ(lines.size(), 4u);
    EXPECT_EQ(lines[0], "skipping " + c.skipped[0]);
    EXPECT_EQ(lines[3], "resuming from " + s2 + " (step 2)");
    for (const auto& l : lines) EXPECT_EQ(l.find("tessera-tmp"), std::string::npos) << l;
    for (const auto& l : lines) EXPECT_EQ(l.find("notes.txt"), std::string::npos) << l;
    // Skipped ones are left exactly as they were.
    EXPECT_TRUE(files_of(last) == last_before);
    EXPECT_TRUE(files_of(s4) == s4_before);
    EXPECT_TRUE(fs::exists(dir + "/broken.ckpt"));

    // Nothing verifies: start fresh, naming the directories.
    corrupt(s2);
    lines.clear();
    c = checkpoint::find_resumable({dir}, collect);
    EXPECT_EQ(c.path, "");
    EXPECT_EQ(c.global_step, 0);
    EXPECT_EQ(c.skipped.size(), 4u);
    ASSERT_FALSE(lines.empty());
    EXPECT_EQ(lines.back(), "no checkpoint that verifies in " + dir + ": starting fresh");

    // Verification in parts (what the collective form gives each rank): the parts' problems
    // together are the whole verification's, each part checks a share of the bytes, and
    // the shares add up to the whole.
    const checkpoint::VerifyReport whole = checkpoint::verify(last);
    ASSERT_FALSE(whole.ok);
    for (int parts : {2, 3}) {
      std::vector<std::string> problems;
      uint64_t bytes = 0;
      for (int part = 0; part < parts; ++part) {
        const checkpoint::VerifyReport r = checkpoint::verify(last, part, parts);
        EXPECT_LT(r.bytes_checked, whole.bytes_checked) << "part " << part << " of " << parts;
        bytes += r.bytes_checked;
        problems.insert(problems.end(), r.problems.begin(), r.problems.end());
      }
      EXPECT_EQ(bytes, whole.bytes_checked) << parts << " parts";
      std::vector<std::string> want = whole.problems;
      std::sort(want.begin(), want.end());
      std::sort(problems.begin(), problems.end());
      EXPECT_EQ(problems, want) << parts << " parts";
    }
    EXPECT_CONTAINS(error_of([&] { checkpoint::verify(last, 2, 2); }), "part 2 of 2 is out of range");

    // SetAside (the Trainer's and gpt's choice): each damaged candidate is renamed
    // X.unverified-<time>, bytes unchanged, and is no candidate afterwards. Only what is a
    // Tessera checkpoint, or was one, goes aside: a file that is no training checkpoint, a
    // user's *.ckpt file or directory that Tessera did not write (broken.ckpt, mydata.ckpt/)
    // stays where it is, and the report says so. A torn save's directory (data files, no
    // metadata) and a consolidated file with a damaged header were Tessera's: aside.
    // Nothing verifies here, so every checkpoint goes aside.
    fs::create_directory(dir + "/mydata.ckpt");
    write_bytes(dir + "/mydata.ckpt/rows.csv", "1,2,3\n");
    fs::copy(sharded ? last + "/data-rank00000.safetensors" : last, tmp.path + "/donor");
    fs::create_directory(dir + "/torn.ckpt");
    fs::copy(tmp.path + "/donor", dir + "/torn.ckpt/data-rank00000.safetensors");
    {
      // A consolidated (or data) file whose header has one damaged byte: its header checksum fails.
      std::string b = read_bytes(tmp.path + "/donor");
      ASSERT_GT(b.size(), 40u);
      b[20] = static_cast<char>(b[20] ^ 0x01);
      write_bytes(dir + "/damaged-header.ckpt", b);
    }
    const auto s2_before = files_of(s2);
    lines.clear();
    c = checkpoint::find_resumable({dir}, collect, checkpoint::Skipped::SetAside);
    EXPECT_EQ(c.path, "");
    ASSERT_EQ(c.skipped.size(), 7u) << ::testing::PrintToString(c.skipped);
    std::map<std::string, std::string> aside;  // original name -> set-aside name
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      const size_t at = n.find(".unverified-");
      if (at != std::string::npos) aside[n.substr(0, at)] = n;
    }
    ASSERT_EQ(aside.size(), 5u) << ::testing::PrintToString(entries(dir));
    for (const std::string n : {"broken.ckpt", "mydata.ckpt"}) {
      EXPECT_FALSE(aside.count(n)) << n;
      EXPECT_TRUE(fs::exists(dir + "/" + n)) << n;
      bool said = false;
      for (const auto& s : c.skipped)
        said |= s.rfind(dir + "/" + n + ": ", 0) == 0 && s.find("(not a Tessera checkpoint: left as it is)") != std::string::npos;
      EXPECT_TRUE(said) << n << ": " << ::testing::PrintToString(c.skipped);
    }
    EXPECT_EQ(read_bytes(dir + "/mydata.ckpt/rows.csv"), "1,2,3\n");
    for (const std::string n : {"torn.ckpt", "damaged-header.ckpt", "last.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=2.ckpt"}) {
      ASSERT_TRUE(aside.count(n)) << n;
      EXPECT_FALSE(fs::exists(dir + "/" + n)) << n;
      bool reported = false;
      for (const auto& s : c.skipped) reported |= s.find("set aside as " + dir + "/" + aside[n]) != std::string::npos;
      EXPECT_TRUE(reported) << n << ": " << ::testing::PrintToString(c.skipped);
    }
    EXPECT_TRUE(files_of(dir + "/" + aside["last.ckpt"]) == last_before);
    EXPECT_TRUE(files_of(dir + "/" + aside["epoch=0-step=4.ckpt"]) == s4_before);
    EXPECT_TRUE(files_of(dir + "/" + aside["epoch=0-step=2.ckpt"]) == s2_before);
    EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
    lines.clear();
    c = checkpoint::find_resumable({dir}, collect, checkpoint::Skipped::SetAside);
    // The user's files are still there, still no candidates, and still said so.
    ASSERT_EQ(c.skipped.size(), 2u) << ::testing::PrintToString(c.skipped);
    ASSERT_EQ(lines.size(), 3u);
    EXPECT_EQ(lines[2], "no checkpoint that verifies in " + dir + ": starting fresh");
  }
}

TEST(ResumeAuto, TrainerStartsFreshThenResumes) {
  TempDir tmp;
  {
    trainer::Trainer t(every_two(tmp.path, 4, true));
    Reg m;
    t.fit(m, regression_data(40), "auto");  // nothing there yet: from step 0
    auto losses = losses_of(read_csv(t.log_dir() + "/metrics.csv"));
    ASSERT_EQ(losses.size(), 4u);
    EXPECT_EQ(losses.begin()->first, 1);
  }
  // The same "auto", further: from step 4, the newest (step 2 and 4 both verify).
  trainer::Trainer t(every_two(tmp.path, 6, true));
  Reg m;
  t.fit(m, regression_data(40), "auto");
  auto losses = losses_of(read_csv(t.log_dir() + "/metrics.csv"));
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_EQ(losses.begin()->first, 5);
  EXPECT_EQ(t.global_step(), 6);

  // No ModelCheckpoint: nowhere to look, an error rather than a silent fresh start.
  auto o = local_options(tmp.path + "/none");
  o.max_steps = 1;
  o.enable_checkpointing = false;
  trainer::Trainer t2(o);
  Reg m2;
  EXPECT_CONTAINS(error_of([&] { t2.fit(m2, regression_data(8), "auto"); }),
                  "ckpt_path \"auto\" looks for checkpoints in the ModelCheckpoint callbacks' directories, but there is "
                  "no ModelCheckpoint callback");
}

// Real rank processes: every rank loads the checkpoint rank 0 chose (the step and the
// module's extra state saved at that step), and rank 0 says which.
TEST(ResumeAuto, TrainerAtOneAndTwoRanks) {
  for (int n : {1, 2}) {
    SCOPED_TRACE(std::to_string(n) + " rank(s)");
    TempDir tmp;
    const std::string root = tmp.path + "/run", dir = root + "/checkpoints";
    auto first = run_ranks(n, {"trainer_fit", "fsdp-sharded", root, "3", "auto"}, 60);
    EXPECT_RANKS_OK(first);
    EXPECT_TRUE(any_line_has(first.out[0], "tessera: no checkpoint that verifies in " + dir + ": starting fresh"))
        << first.all_output();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(any_line_has(first.out[r], "restored -1")) << first.all_output();
    ASSERT_TRUE(fs::exists(dir + "/last.ckpt"));

    // A good older checkpoint beside a corrupted newer last.ckpt.
    fs::copy(dir + "/last.ckpt", dir + "/step3.ckpt", fs::copy_options::recursive);
    auto again = run_ranks(n, {"trainer_fit", "fsdp-sharded", root, "5", "auto"}, 60);
    EXPECT_RANKS_OK(again);
    EXPECT_TRUE(any_line_has(again.out[0], "tessera: resuming from ")) << again.all_output();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(any_line_has(again.out[r], "restored 30")) << again.all_output();

    corrupt(dir + "/last.ckpt");  // step 5 now: step3.ckpt is the newest that verifies
    auto third = run_ranks(n, {"trainer_fit", "fsdp-sharded", root, "4", "auto"}, 60);
    EXPECT_RANKS_OK(third);
    EXPECT_TRUE(any_line_has(third.out[0], "tessera: skipping " + dir + "/last.ckpt: ")) << third.all_output();
    // Set aside (not replaced by this run's save of last.ckpt), and found by one rank's part.
    EXPECT_TRUE(any_line_has(third.out[0], "; set aside as " + dir + "/last.ckpt.unverified-")) << third.all_output();
    if (n == 2) EXPECT_TRUE(any_line_has(third.out[0], "(found by rank ")) << third.all_output();
    int aside = 0;
    for (const auto& e : fs::directory_iterator(dir))
      aside += e.path().filename().string().rfind("last.ckpt.unverified-", 0) == 0;
    EXPECT_EQ(aside, 1);
    EXPECT_TRUE(fs::exists(dir + "/last.ckpt")) << "the run's own save of last.ckpt";
    EXPECT_TRUE(any_line_has(third.out[0], "tessera: resuming from " + dir + "/step3.ckpt (step 3)"))
        << third.all_output();
    for (int r = 0; r < n; ++r) EXPECT_TRUE(any_line_has(third.out[r], "restored 30")) << third.all_output();
    if (n == 2) EXPECT_FALSE(any_line_has(third.out[1], "skipping") || any_line_has(third.out[1], "resuming from"))
        << "only rank 0 reports:\n" << third.all_output();
  }
}

// Issue 44 item 1: rank 0 sends the other ranks the candidates typed (lengths, not lines),
// each a plain name inside a directory searched. A checkpoint directory whose name holds a
// newline ("zz\n30 <name>") once split into two candidates, the second a path relative to
// the working directory (a step-3 checkpoint placed there loaded as "step 30"). Now such a
// name is no candidate, is reported escaped and left as it is, and nothing outside the
// directory is ever loaded.
TEST(ResumeAuto, CandidateNamesNeverLeadOutOfTheDirectory) {
  TempDir tmp;
  const std::string root = tmp.path + "/run", dir = root + "/checkpoints";
  auto first = run_ranks(2, {"trainer_fit", "fsdp-sharded", root, "3", "auto"}, 60);
  EXPECT_RANKS_OK(first);
  ASSERT_TRUE(fs::exists(dir + "/last.ckpt"));
  // In the ranks' working directory (this test's): what the injected line names.
  const std::string evil = "tessera-evil-" + std::to_string(::getpid()) + ".ckpt";
  struct Remove {
    std::string p;
    ~Remove() { fs::remove_all(p); }
  } remove_evil{fs::absolute(evil).string()};
  fs::copy(dir + "/last.ckpt", evil, fs::copy_options::recursive);
  const std::string odd = "zz\n30 " + evil;
  fs::copy(dir + "/last.ckpt", dir + "/" + odd, fs::copy_options::recursive);
  fs::copy(dir + "/last.ckpt", dir + "/step3.ckpt", fs::copy_options::recursive);
  corrupt(dir + "/last.ckpt");
  const auto odd_before = files_of(dir + "/" + odd);

  auto again = run_ranks(2, {"trainer_fit", "fsdp-sharded", root, "4", "auto"}, 60);
  EXPECT_RANKS_OK(again);
  EXPECT_FALSE(any_line_has(again.out[0], evil + " (step")) << again.all_output();
  EXPECT_TRUE(any_line_has(again.out[0], "tessera: resuming from " + dir + "/step3.ckpt (step 3)")) << again.all_output();
  EXPECT_TRUE(any_line_has(again.out[0], "tessera: skipping " + dir + "/zz\\n30 " + evil +
                                             ": its name holds a control character: not a candidate (left as it is"))
      << again.all_output();
  // Left exactly as it was, under its own name; the evil copy was not touched either.
  EXPECT_TRUE(files_of(dir + "/" + odd) == odd_before);
  EXPECT_TRUE(fs::exists(evil));

  // Every reader refuses such a path itself (docs/checkpoint-format.md §4).
  EXPECT_CONTAINS(error_of([&] { checkpoint::open_checkpoint(dir + "/" + odd); }),
                  "it contains a control character ('\\n' at byte");
}
