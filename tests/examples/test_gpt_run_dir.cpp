// `gpt train` and its run directory, exit codes and validation limit (issue 35, items 11
// and 19, and the validation limit):
//  - a new run (no --resume) refuses an --out that holds an earlier run (checkpoints/,
//    metrics.csv or hparams.yaml) and changes nothing there, naming --resume and
//    --overwrite; --overwrite starts over on purpose; an empty directory is fine;
//  - a flag's bad value (--max-steps 0) is a usage error: exit 2 naming the flag (CLI11's
//    own code was 105);
//  - --limit-val-batches 0 runs no validation (no val_loss anywhere), N bounds it;
//  - "gpt: error: ..." is one write(2): a rank stopped by the launcher's SIGTERM between
//    two writes (after rank 0 died) used to print an empty "gpt: error: ".
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

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
using tessera::testing::gpt::read_metrics;

namespace {

const std::string kShape = " --n-layer 2 --n-head 2 --d-model 32 --seq-len 16";
const std::string kRun = " --strategy single --batch-size 8 --lr 3e-3 --seed 5 --log-every 1 --threads 1 --no-progress-bar";

struct RunDir {
  std::string dir, data;
  RunDir() : dir(temp_dir("tessera-gpt-rundir")) {
    data = dir + "/text.txt";
    std::ostringstream s;
    for (int i = 0; i < 600; ++i) s << (i % 3 ? "shard tensor " : "rank gather.\n");
    write_bytes(data, s.str());
  }
  std::pair<int, std::string> train(const std::string& out, const std::string& extra) const {
    return run_command(kNoLauncherEnv + kGpt + " train --data " + data + " --out " + out + kRun + extra);
  }
};

// Every file under `dir` but run.lock (relative path -> bytes; directories as "<dir>").
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    if (rel != "run.lock") m[rel] = e.is_directory() ? "<dir>" : read_bytes(e.path().string());
  }
  return m;
}

}  // namespace

class GptRunDir : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  }
};

TEST_F(GptRunDir, NewRunRefusesAnEarlierRunAndOverwriteStartsOver) {
  RunDir r;
  const std::string out = r.dir + "/run";
  auto [rc1, o1] = r.train(out, " --max-steps 2 --val-every 0" + kShape);
  ASSERT_EQ(rc1, 0) << o1;
  const auto before = snapshot(out);
  ASSERT_TRUE(before.count("checkpoints/last.ckpt") && before.count("metrics.csv") && before.count("hparams.yaml"));

  // Another model shape into the same --out, without --resume: refused, nothing changed.
  auto [rc2, o2] = r.train(out, " --max-steps 3 --val-every 0 --n-layer 1 --n-head 2 --d-model 32 --seq-len 16");
  EXPECT_EQ(rc2, 1) << o2;
  for (const std::string& s : {"gpt: error: run directory '" + out + "' holds an earlier run (checkpoints/, metrics.csv, "
                               "hparams.yaml)", std::string("--resume last"), std::string("--overwrite")})
    EXPECT_NE(o2.find(s), std::string::npos) << "no '" << s << "':\n" << o2;
  EXPECT_EQ(o2.find("gpt: done"), std::string::npos) << o2;
  EXPECT_TRUE(snapshot(out) == before) << "a refused run changed the run directory";

  // Only metrics.csv left of it: still an earlier run.
  const std::string partial = r.dir + "/partial";
  fs::create_directories(partial);
  write_bytes(partial + "/metrics.csv", "step,epoch,train_loss\n1,0,5.5\n");
  auto [rc3, o3] = r.train(partial, " --max-steps 1 --val-every 0" + kShape);
  EXPECT_EQ(rc3, 1) << o3;
  EXPECT_NE(o3.find("holds an earlier run (metrics.csv)"), std::string::npos) << o3;
  EXPECT_EQ(read_bytes(partial + "/metrics.csv"), "step,epoch,train_loss\n1,0,5.5\n");

  // --overwrite with --resume: a usage error.
  auto [rc4, o4] = r.train(out, " --max-steps 3 --overwrite --resume last");
  EXPECT_EQ(rc4, 2) << o4;
  EXPECT_NE(o4.find("--overwrite and --resume exclude each other"), std::string::npos) << o4;

  // --overwrite: a new run over the old one, of another shape.
  auto [rc5, o5] = r.train(out, " --max-steps 1 --val-every 0 --overwrite --n-layer 1 --n-head 2 --d-model 32 --seq-len 16");
  ASSERT_EQ(rc5, 0) << o5;
  EXPECT_NE(read_bytes(out + "/hparams.yaml").find("n_layer: 1"), std::string::npos) << read_bytes(out + "/hparams.yaml");
  EXPECT_EQ(read_metrics(out + "/metrics.csv")["train_loss"].size(), 1u) << read_bytes(out + "/metrics.csv");

  // An empty existing directory is a new run's directory.
  const std::string empty = r.dir + "/empty";
  fs::create_directories(empty);
  auto [rc6, o6] = r.train(empty, " --max-steps 1 --val-every 0" + kShape);
  EXPECT_EQ(rc6, 0) << o6;
}

TEST_F(GptRunDir, BadFlagValuesAreUsageErrorsWithExitCode2) {
  struct Case {
    std::string args, expect;
  };
  for (const Case& c : std::vector<Case>{{"train --max-steps 0", "--max-steps: must be an integer >= 1, got '0'"},
                                         {"train --limit-val-batches -1", "--limit-val-batches: must be an integer >= 0, got '-1'"}}) {
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + " " + c.args);
    EXPECT_EQ(rc, 2) << c.args << "\n" << out;
    EXPECT_NE(out.find(c.expect), std::string::npos) << c.args << "\n" << out;
  }
  auto [rc, help] = run_command(kGpt + " train --help");
  EXPECT_EQ(rc, 0) << help;
  for (const char* s : {"--limit-val-batches", "0: no validation at all", "2 usage error", "--overwrite"})
    EXPECT_NE(help.find(s), std::string::npos) << "no '" << s << "' in --help:\n" << help;
}

TEST_F(GptRunDir, LimitValBatchesZeroRunsNoValidation) {
  RunDir r;
  // Validation due every step and at the end, but none at all: no val_loss anywhere.
  auto [rc, out] = r.train(r.dir + "/none", " --max-steps 2 --val-every 1 --limit-val-batches 0" + kShape);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("val_loss=nan"), std::string::npos) << out;
  const std::string csv = read_bytes(r.dir + "/none/metrics.csv");
  EXPECT_EQ(csv.find("val_loss"), std::string::npos) << csv;
  EXPECT_EQ(read_metrics(r.dir + "/none/metrics.csv")["train_loss"].size(), 2u) << csv;
  // One batch per validation: a val_loss at both steps, and a finite final one.
  auto [rc1, out1] = r.train(r.dir + "/one", " --max-steps 2 --val-every 1 --limit-val-batches 1" + kShape);
  ASSERT_EQ(rc1, 0) << out1;
  EXPECT_EQ(out1.find("val_loss=nan"), std::string::npos) << out1;
  EXPECT_EQ(read_metrics(r.dir + "/one/metrics.csv")["val_loss"].size(), 2u) << read_bytes(r.dir + "/one/metrics.csv");
}

// stderr on a SOCK_SEQPACKET socket keeps the boundaries of write(2) calls: the error line
// must arrive as one message (it came as "gpt: error: ", then the text, then "\n").
TEST_F(GptRunDir, ErrorLineIsOneWrite) {
  RunDir r;
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv), 0);
  const std::string cmd = "exec " + kNoLauncherEnv + kGpt + " train --data " + r.data + " --out " + r.dir +
                          "/run --resume " + r.dir + "/nothing.ckpt" + kRun + kShape;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(sv[1], 2);
    ::close(sv[0]);
    ::close(sv[1]);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(sv[1]);
  std::vector<std::string> writes;
  std::vector<char> buf(1 << 20);
  for (;;) {
    const ssize_t n = ::recv(sv[0], buf.data(), buf.size(), 0);
    if (n <= 0) break;
    writes.emplace_back(buf.data(), static_cast<size_t>(n));
  }
  ::close(sv[0]);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << st;
  std::string all, line;
  for (const auto& w : writes) {
    all += w;
    if (w.rfind("gpt: error: ", 0) == 0) line = w;
  }
  EXPECT_EQ(line, "gpt: error: --resume: checkpoint '" + r.dir + "/nothing.ckpt' does not exist\n")
      << writes.size() << " writes:\n" << all;
}
