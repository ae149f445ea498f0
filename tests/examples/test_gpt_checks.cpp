// The GPT example (build/bin/gpt) against bad input and concurrent use, on real runs:
//  - `gpt sample` and `gpt train --resume` check a checkpoint's stored hparams like the
//    flags (edited with a valid metadata checksum, as an attacker would) and its weights'
//    shapes against them before building anything;
//  - a resume with an explicit model-shaping flag that disagrees with the checkpoint is
//    refused, naming both values; flags left out take the checkpoint's values;
//  - a second run with the same --out stops at start ("in use by pid N");
//  - a resume with --max-steps at or below the checkpoint's step changes nothing on disk;
//  - float flags refuse nan/inf and print their bounds readably; --ckpt-every's help;
//  - with 2 ranks on a terminal, rank 0's progress bar is redrawn live by the launcher.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include <chrono>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/build_paths.h"
#include "support/test_util.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/reader.h"

namespace fs = std::filesystem;
namespace ck = tessera::checkpoint;
using tessera::testing::kNoLauncherEnv;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;

namespace {

const std::string kGpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
const std::string kCli = TESSERA_CLI;
// The tiny model's shape, and the rest of a quick run.
const std::string kShape = " --n-layer 2 --n-head 2 --d-model 32 --seq-len 16";
const std::string kRun = " --batch-size 8 --lr 3e-3 --seed 5 --log-every 1 --val-every 2 --threads 1 --no-progress-bar";

std::string make_text() {
  std::ostringstream s;
  const char* words[] = {"shard", "tensor", "rank", "gather", "scatter", "reduce", "checkpoint", "module"};
  for (int i = 0; i < 1500; ++i) s << words[(i * 5 + i / 3) % 8] << ((i % 9 == 8) ? ".\n" : " ");
  return s.str();
}

struct GptDir {
  std::string dir, data;
  GptDir() : dir(temp_dir("tessera-gpt-checks")) {
    data = dir + "/text.txt";
    write_bytes(data, make_text());
  }
  // `gpt train` writing to `out` (single process, sharded checkpoint).
  std::string train(const std::string& out, const std::string& extra) const {
    return kNoLauncherEnv + kGpt + " train --strategy single --state-dict sharded --data " + data + " --out " + out + kRun + extra;
  }
};

// Every file under `dir` (relative path -> bytes; directories as "<dir>").
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> m;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    m[rel] = e.is_directory() ? "<dir>" : read_bytes(e.path().string());
  }
  return m;
}

// Rewrites hparams.KEY of a sharded checkpoint through the library (the metadata
// checksum is recomputed, as an attacker editing the file would).
void set_hparam(const std::string& ckpt, const std::string& key, const tessera::state::Value& v) {
  ck::CheckpointMetadata m = ck::open_checkpoint(ckpt);
  ck::EntryInfo& e = m.entries.at("hparams." + key);
  e.value = v;
  e.kind = tessera::state::kind_name(v);
  write_bytes(ckpt + "/tessera-checkpoint.json", ck::to_json(m));
}

// No crash, no libtorch backtrace, no std:: exception text leaking through.
void expect_clean_error(int rc, const std::string& out, const std::string& what) {
  EXPECT_EQ(rc, 1) << what << "\n" << out;
  EXPECT_NE(out.find("gpt: error: "), std::string::npos) << what << "\n" << out;
  for (const char* bad : {"Exception raised from", "frame #", "terminate called", "stoll", "Floating point"})
    EXPECT_EQ(out.find(bad), std::string::npos) << what << " printed '" << bad << "':\n" << out;
}

// Runs `cmd` through sh with stdout and stderr on a new pseudo-terminal `cols` wide;
// returns its exit status and everything written to the terminal ('\n' arrives as "\r\n").
std::pair<int, std::string> run_on_terminal(const std::string& cmd, int cols) {
  const int m = ::posix_openpt(O_RDWR | O_NOCTTY);
  if (m < 0 || ::grantpt(m) != 0 || ::unlockpt(m) != 0) return {-1, "cannot create a pseudo-terminal"};
  const std::string slave = ::ptsname(m);
  struct winsize ws {};
  ws.ws_row = 50;
  ws.ws_col = static_cast<unsigned short>(cols);
  const pid_t pid = ::fork();
  if (pid < 0) return {-1, "fork failed"};
  if (pid == 0) {
    ::setsid();
    const int s = ::open(slave.c_str(), O_RDWR);  // the new session's controlling terminal
    if (s < 0) ::_exit(126);
    ::ioctl(s, TIOCSWINSZ, &ws);
    ::dup2(s, 1);
    ::dup2(s, 2);
    ::close(s);
    ::close(m);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  std::string out;
  char buf[4096];
  for (;;) {  // until EIO: every process holding the terminal has ended
    const ssize_t n = ::read(m, buf, sizeof buf);
    if (n > 0) out.append(buf, static_cast<size_t>(n));
    else if (n < 0 && errno == EINTR) continue;
    else break;
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  ::close(m);
  return {WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st), out};
}

}  // namespace

class GptChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  }
};

TEST_F(GptChecks, StoredHparamsAreCheckedLikeFlags) {
  GptDir r;
  auto [rc, out] = run_command(r.train(r.dir + "/run", " --max-steps 2" + kShape));
  ASSERT_EQ(rc, 0) << out;
  const std::string good = r.dir + "/run/checkpoints/last.ckpt";
  ASSERT_TRUE(fs::is_directory(good));
  struct Case {
    std::string key;
    tessera::state::Value value;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"n_head", std::string("0"), {"hparams.n_head must be an integer in [1, 1024], got '0'", "--n-head"}},
      {"n_layer", std::string("100000"), {"hparams.n_layer must be an integer in [1, 1024], got '100000'"}},
      {"d_model", std::string("abc"), {"hparams.d_model must be an integer", "got 'abc'"}},
      {"seq_len", std::string("-5"), {"hparams.seq_len must be an integer in [1, 1048576], got '-5'"}},
      {"n_head", std::string("3"), {"hparams.d_model 32 is not a multiple of hparams.n_head 3"}},
      {"tie_weights", std::string("yes"), {"hparams.tie_weights must be 'true' or 'false', got 'yes'"}},
      {"n_head", int64_t{2}, {"hparams.n_head is of kind 'int', not the text gpt train stores"}},
      // In range, but the stored weights disagree: refused from the metadata, before any
      // model is built (1000 layers of width 32 would still be built quickly; 1024 x
      // 65536 would not, and takes the same path).
      {"n_layer", std::string("1000"), {"its weights do not match its hparams", "model.blocks.10.fc.bias [128] is missing"}},
      {"d_model", std::string("65536"), {"its weights do not match its hparams", "model.blocks.0.fc.bias is [128], not [262144]"}},
      {"n_layer", std::string("1"), {"model.blocks.1.fc.bias is not a weight of that model"}},
      {"tie_weights", std::string("true"), {"model.head.weight is not a weight of that model"}},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string bad = r.dir + "/bad" + std::to_string(i++) + ".ckpt";
    fs::copy(good, bad, fs::copy_options::recursive);
    set_hparam(bad, c.key, c.value);
    for (const std::string& cmd : std::vector<std::string>{kGpt + " sample --tokens 4 --ckpt " + bad,
                                                           r.train(r.dir + "/run", " --max-steps 4 --resume " + bad)}) {
      auto [brc, bout] = run_command(cmd);
      const std::string what = c.key + " case " + std::to_string(i) + ": " + cmd;
      expect_clean_error(brc, bout, what);
      EXPECT_NE(bout.find("checkpoint '" + bad + "'"), std::string::npos) << what << "\n" << bout;
      for (const auto& e : c.expect) EXPECT_NE(bout.find(e), std::string::npos) << what << ": no '" << e << "'\n" << bout;
    }
  }
  // The untouched checkpoint still samples.
  auto [src, sout] = run_command(kGpt + " sample --tokens 4 --ckpt " + good);
  EXPECT_EQ(src, 0) << sout;
}

TEST_F(GptChecks, ResumeRefusesAnotherModelShapeAndAdoptsFlagsLeftOut) {
  GptDir r;
  const std::string out = r.dir + "/run";
  auto [rc, o1] = run_command(r.train(out, " --max-steps 2" + kShape));
  ASSERT_EQ(rc, 0) << o1;
  const auto before = snapshot(out);
  // Same weight shapes, another head count: refused, naming the key and both values.
  auto [rc2, o2] = run_command(r.train(out, " --max-steps 4 --resume last --n-layer 2 --n-head 4 --d-model 32"));
  expect_clean_error(rc2, o2, "--n-head 4");
  EXPECT_NE(o2.find("--n-head 4 but the checkpoint has n_head 2"), std::string::npos) << o2;
  EXPECT_NE(o2.find(out + "/checkpoints/last.ckpt"), std::string::npos) << o2;
  auto [rc3, o3] = run_command(r.train(out, " --max-steps 4 --resume last --tie-weights --seq-len 32"));
  expect_clean_error(rc3, o3, "--tie-weights --seq-len 32");
  EXPECT_NE(o3.find("--seq-len 32 but the checkpoint has seq_len 16; --tie-weights but the checkpoint has "
                    "tie_weights false"),
            std::string::npos)
      << o3;
  EXPECT_EQ(snapshot(out), before) << "a refused resume changed the run directory";
  // Model flags left out (defaults 4 layers, 4 heads, width 128): the checkpoint's values.
  auto [rc4, o4] = run_command(r.train(out, " --max-steps 4 --resume last"));
  ASSERT_EQ(rc4, 0) << o4;
  EXPECT_NE(o4.find("resuming with the checkpoint's n_layer 2, n_head 2, d_model 32, seq_len 16"), std::string::npos)
      << o4;
  EXPECT_NE(o4.find("steps_this_run=2"), std::string::npos) << o4;
  const ck::CheckpointMetadata m = ck::open_checkpoint(out + "/checkpoints/last.ckpt");
  EXPECT_EQ(std::get<std::string>(m.entries.at("hparams.n_head").value), "2");
  EXPECT_EQ(std::get<int64_t>(m.entries.at("global_step").value), 4);
  // Explicit flags equal to the checkpoint's are accepted.
  auto [rc5, o5] = run_command(r.train(out, " --max-steps 6 --resume last" + kShape));
  ASSERT_EQ(rc5, 0) << o5;
  EXPECT_EQ(o5.find("resuming with the checkpoint's"), std::string::npos) << o5;
}

TEST_F(GptChecks, ResumeWithNothingLeftToDoChangesNothing) {
  GptDir r;
  const std::string out = r.dir + "/run";
  auto [rc, o1] = run_command(r.train(out, " --max-steps 4" + kShape));
  ASSERT_EQ(rc, 0) << o1;
  const auto before = snapshot(out);
  ASSERT_TRUE(before.count("metrics.csv"));
  ASSERT_TRUE(before.count("hparams.yaml"));
  for (const std::string steps : {"4", "3"}) {
    auto [rc2, o2] = run_command(r.train(out, " --resume last --max-steps " + steps));
    EXPECT_EQ(rc2, 0) << o2;
    EXPECT_NE(o2.find("gpt: nothing left to do: '" + out + "/checkpoints/last.ckpt' is at step 4 and --max-steps is " +
                      steps + "; the run directory is unchanged"),
              std::string::npos)
        << o2;
    const auto after = snapshot(out);
    EXPECT_EQ(after.size(), before.size());
    for (const auto& [path, bytes] : before) {
      auto it = after.find(path);
      ASSERT_NE(it, after.end()) << path << " disappeared";
      EXPECT_TRUE(it->second == bytes) << path << " changed (--max-steps " << steps << ")";
    }
  }
}

// Two real processes: A trains (until killed), B starts with the same --out on 2 ranks.
TEST_F(GptChecks, SecondRunOnTheSameOutStopsAtStart) {
  GptDir r;
  const std::string out = r.dir + "/run";
  const std::string log_a = r.dir + "/a.log";
  const std::string cmd_a = "exec " + r.train(out, " --max-steps 1000000" + kShape) + " >" + log_a + " 2>&1";
  const pid_t a = ::fork();
  ASSERT_GE(a, 0);
  if (a == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd_a.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      if (pid <= 0) return;  // never kill(-1) or kill(0)
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{a};
  // A holds the lock once it writes hparams.yaml (the Trainer's logger setup comes after it).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(3);
  while (!fs::exists(out + "/hparams.yaml")) {
    int st = 0;
    ASSERT_EQ(::waitpid(a, &st, WNOHANG), 0) << "run A ended early:\n" << read_bytes(log_a);
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "run A did not start:\n" << read_bytes(log_a);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(fs::is_regular_file(out + "/run.lock"));
  const std::string cmd_b = kNoLauncherEnv + kCli + " run -n 2 -- " + kGpt + " train --strategy ddp --state-dict sharded --max-steps 2 --data " +
                            r.data + " --out " + out + kRun + kShape;
  auto [rc_b, out_b] = run_command(cmd_b);
  EXPECT_NE(rc_b, 0) << out_b;
  const std::string msg = "gpt: error: run directory '" + out + "' is in use by pid " + std::to_string(a);
  EXPECT_NE(out_b.find("[rank 0] " + msg), std::string::npos) << out_b;
  EXPECT_EQ(out_b.find("gpt: done"), std::string::npos) << out_b;
  // The same from one process.
  auto [rc_c, out_c] = run_command(r.train(out, " --max-steps 2" + kShape));
  EXPECT_EQ(rc_c, 1) << out_c;
  EXPECT_NE(out_c.find(msg), std::string::npos) << out_c;
  int st = 0;
  EXPECT_EQ(::waitpid(a, &st, WNOHANG), 0) << "run A stopped:\n" << read_bytes(log_a);
  // Once A is gone (killed: no clean-up of its own), the directory is free again (A's
  // files in it are an earlier run: a new run replaces them only with --overwrite).
  ::kill(a, SIGKILL);
  ::waitpid(a, nullptr, 0);
  reap.pid = -1;
  auto [rc_d, out_d] = run_command(cmd_b + " --overwrite");
  EXPECT_EQ(rc_d, 0) << out_d;
}

TEST_F(GptChecks, NumericFlagsRefuseNonFiniteValuesAndPrintBoundsReadably) {
  struct Case {
    std::string args, expect;
  };
  const std::vector<Case> cases = {
      {"train --lr nan", "--lr: must be a finite number > 0, got 'nan'"},
      {"train --lr inf", "--lr: must be a finite number > 0, got 'inf'"},
      {"train --lr -1", "--lr: must be > 0, got '-1'"},
      {"train --lr 0", "--lr: must be > 0, got '0'"},
      {"train --grad-clip nan", "--grad-clip: must be a finite number >= 0, got 'nan'"},
      {"train --val-fraction 2", "--val-fraction: must be >= 0 and <= 0.9, got '2'"},
      {"train --val-fraction nan", "--val-fraction: must be a finite number >= 0 and <= 0.9, got 'nan'"},
      {"train --max-steps 0", "--max-steps: must be an integer >= 1, got '0'"},
      {"train --n-head 2000", "--n-head: must be an integer in [1, 1024], got '2000'"},
      {"train --d-model 1.5", "--d-model: must be an integer in [1, 65536], got '1.5'"},
      {"sample --ckpt x --temperature nan", "--temperature: must be a finite number >= 0, got 'nan'"},
      {"sample --ckpt x --top-k 999", "--top-k: must be an integer in [0, 256], got '999'"},
  };
  for (const auto& c : cases) {
    auto [rc, out] = run_command(kNoLauncherEnv + kGpt + " " + c.args);
    EXPECT_NE(rc, 0) << c.args << "\n" << out;
    EXPECT_NE(out.find(c.expect), std::string::npos) << c.args << "\n" << out;
    EXPECT_EQ(out.find("Exception raised from"), std::string::npos) << c.args << "\n" << out;
    EXPECT_EQ(out.find("179769313486"), std::string::npos) << c.args << " printed DBL_MAX:\n" << out;
    EXPECT_LT(out.size(), 400u) << c.args << "\n" << out;
  }
  // --ckpt-every 0's help says what the code does: last.ckpt after each validation too.
  auto [rc, help] = run_command(kGpt + " train --help");
  EXPECT_EQ(rc, 0) << help;
  EXPECT_NE(help.find("0: after each validation, see --val-every, and at the end"), std::string::npos) << help;
}

// gpt --devices 2 runs its ranks through the launcher, which used to relay whole lines
// only, so rank 0 (stderr a pipe) printed a plain line a second at most. On a terminal
// the launcher now shows rank 0's bar live: "\r[rank 0] train epoch 0: ... ETA ..."
// redrawn in place, cut to the terminal's width.
TEST_F(GptChecks, TwoRanksOnATerminalShowALiveProgressBar) {
  GptDir r;
  const int cols = 150;
  auto [rc, out] = run_on_terminal(kNoLauncherEnv + kGpt + " train --strategy ddp --devices 2 --max-steps 40 --val-every 0 --data " +
                                       r.data + " --out " + r.dir + "/run --batch-size 8 --seed 5 --threads 1" + kShape,
                                   cols);
  ASSERT_EQ(rc, 0) << out;
  size_t live = 0;
  const std::string head = "\r[rank 0] train epoch 0: ";
  for (size_t p = out.find(head); p != std::string::npos; p = out.find(head, p + 1)) {
    const size_t end = out.find_first_of("\r\n", p + 1);
    const std::string drawn = out.substr(p + 1, end == std::string::npos ? std::string::npos : end - p - 1);
    EXPECT_LE(drawn.size(), static_cast<size_t>(cols)) << drawn;
    if (drawn.find("ETA") != std::string::npos) ++live;
  }
  EXPECT_GE(live, 1u) << "no live progress line from rank 0:\n" << out;
  // The stage's last state stays, as a line of its own, and the run's summary follows.
  EXPECT_NE(out.find("40/"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] gpt: done step=40"), std::string::npos) << out;
}
