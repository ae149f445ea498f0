// `tessera ckpt import-dcp` against checkpoints written by PyTorch 2.x's own dcp.save
// (tests/python/dcp_write.py, 2 ranks on Gloo started by `tessera run -n 2`), read back by
// the real libraries: torch.load of a `tessera ckpt export --format torch` of the import,
// and safetensors' reader of its `tessera ckpt consolidate`, compared bit for bit with
// what Python saved. Compiled only where the tests' Python has torch.distributed.checkpoint.
#include <gtest/gtest.h>

#include "support/build_paths.h"
#include "tessera_tests/python_features.h"

#if TESSERA_PYTHON_HAS_DCP

#include <sys/stat.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <system_error>
#include <string>

#include "support/test_util.h"

namespace fs = std::filesystem;
using tessera::testing::kNoLauncherEnv;
using tessera::testing::read_bytes;
using tessera::testing::run_command;
using tessera::testing::temp_dir;
using tessera::testing::write_bytes;

namespace {

const std::string kCli = TESSERA_CLI;
const std::string kPython = TESSERA_PYTHON;
const std::string kScript = std::string(TESSERA_SOURCE_DIR) + "/tests/python/dcp_write.py";

}  // namespace

class DcpImport : public ::testing::Test {
 protected:
  // One DCP checkpoint for the whole suite (two Python ranks take a while to start),
  // read only by the tests; each test writes into a directory of its own (work()).
  static void SetUpTestSuite() {
    std::string tmpl = "/tmp/tessera-dcp-src-XXXXXX";
    written_ = new std::string(::mkdtemp(tmpl.data()) ? "" : "mkdtemp failed");
    src_ = new std::string(tmpl);
    if (!written_->empty()) return;
    auto [rc, out] = run_command(kNoLauncherEnv + kCli + " run -n 2 -- " + kPython + " " + kScript + " write " + *src_);
    if (rc != 0) *written_ = "dcp_write.py failed (" + std::to_string(rc) + "):\n" + out;
  }
  static void TearDownTestSuite() {
    const auto* suite = ::testing::UnitTest::GetInstance()->current_test_suite();
    if (suite && suite->Failed()) {
      std::cerr << "kept for post-mortem: " << *src_ << std::endl;
    } else {
      std::error_code ec;
      fs::remove_all(*src_, ec);
    }
    delete src_;
    delete written_;
    src_ = written_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(written_->empty()) << *written_;
    work_ = temp_dir("tessera-dcp");
  }
  static std::string src() { return *src_; }       // expected.pt, expected_values.json
  static std::string dcp() { return *src_ + "/dcp"; }
  std::string dir() const { return work_; }        // this test's outputs

  static std::string* src_;
  static std::string* written_;
  std::string work_;

};
std::string* DcpImport::src_ = nullptr;
std::string* DcpImport::written_ = nullptr;

TEST_F(DcpImport, EveryTensorAndValueArrivesBitExact) {
  const std::string out = dir() + "/imported";
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + out);
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("from 2 DCP writer(s)"), std::string::npos) << text;
  EXPECT_TRUE(fs::exists(out + "/tessera-checkpoint.json"));
  EXPECT_TRUE(fs::exists(out + "/data-rank00000.safetensors"));
  EXPECT_TRUE(fs::exists(out + "/data-rank00001.safetensors"));

  auto [rcv, verify] = run_command(kCli + " ckpt verify " + out);
  EXPECT_EQ(rcv, 0) << verify;
  // DCP's chunks are kept: the dim-0 shards of 5 rows are 3 + 2, in the files of their writers.
  auto [rci, inspect] = run_command(kCli + " ckpt inspect " + out);
  ASSERT_EQ(rci, 0) << inspect;
  EXPECT_NE(inspect.find("world size at save 2"), std::string::npos) << inspect;

  // Read back by torch.load (export) and by safetensors (consolidate), compared with Python's.
  auto [rce, exp] = run_command(kCli + " ckpt export " + out + " --format torch -o " + dir() + "/imported.pt");
  ASSERT_EQ(rce, 0) << exp;
  auto [rcc, cons] = run_command(kCli + " ckpt consolidate " + out + " -o " + dir() + "/imported.safetensors");
  ASSERT_EQ(rcc, 0) << cons;
  auto [rcp, py] = run_command(kPython + " " + kScript + " check " + src() + " " + dir() + "/imported.pt " + dir() +
                               "/imported.safetensors");
  EXPECT_EQ(rcp, 0) << py;

  // It loads at another world size too: resharded for 3 ranks, the same bits.
  auto [rcr, re] = run_command(kCli + " ckpt reshard " + out + " --world-size 3 -o " + dir() + "/imported3");
  ASSERT_EQ(rcr, 0) << re;
  auto [rce3, exp3] = run_command(kCli + " ckpt export " + dir() + "/imported3 --format torch -o " + dir() + "/i3.pt");
  ASSERT_EQ(rce3, 0) << exp3;
  auto [rcc3, cons3] = run_command(kCli + " ckpt consolidate " + dir() + "/imported3 -o " + dir() + "/i3.safetensors");
  ASSERT_EQ(rcc3, 0) << cons3;
  auto [rcp3, py3] = run_command(kPython + " " + kScript + " check " + src() + " " + dir() + "/i3.pt " + dir() +
                                 "/i3.safetensors");
  EXPECT_EQ(rcp3, 0) << py3;
}

// FileSystemWriter(thread_count=2): each rank writes two files (__<rank>_0, __<rank>_1);
// their chunks go to the data file of that rank.
TEST_F(DcpImport, TwoFilesPerRankImportBitExact) {
  ASSERT_TRUE(fs::exists(src() + "/dcp_threads/__1_1.distcp"));
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + src() + "/dcp_threads -o " + dir() + "/imported");
  ASSERT_EQ(rc, 0) << text;
  EXPECT_NE(text.find("from 2 DCP writer(s)"), std::string::npos) << text;
  auto [rce, exp] = run_command(kCli + " ckpt export " + dir() + "/imported --format torch -o " + dir() + "/t.pt");
  ASSERT_EQ(rce, 0) << exp;
  auto [rcp, py] = run_command(kPython + " " + kScript + " check-threads " + src() + " " + dir() + "/t.pt");
  EXPECT_EQ(rcp, 0) << py;
}

// No code in a DCP directory runs: a .metadata whose pickle would call os.system is
// refused naming the file and the global, and the command it carries never ran.
TEST_F(DcpImport, ForbiddenGlobalIsRefusedNamingFileAndGlobal) {
  const std::string evil = dir() + "/evil", marker = dir() + "/pwned";
  auto [rc, out] = run_command(kPython + " " + kScript + " evil " + dcp() + " " + evil + " " + marker);
  ASSERT_EQ(rc, 0) << out;
  auto [rci, text] = run_command(kCli + " ckpt import-dcp " + evil + " -o " + dir() + "/evil-out");
  EXPECT_NE(rci, 0) << text;
  EXPECT_NE(text.find(evil + "/.metadata"), std::string::npos) << text;
  EXPECT_NE(text.find("refusing the global 'posix.system'"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(marker));
  EXPECT_FALSE(fs::exists(dir() + "/evil-out"));
}

TEST_F(DcpImport, TruncatedDataFileIsAnErrorNamingIt) {
  const std::string cut = dir() + "/cut";
  fs::copy(dcp(), cut, fs::copy_options::recursive);
  const std::string victim = cut + "/__1_0.distcp";
  ASSERT_TRUE(fs::exists(victim));
  const auto size = fs::file_size(victim);
  ASSERT_GT(size, 64u);
  fs::resize_file(victim, size / 2);
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + cut + " -o " + dir() + "/cut-out");
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find(victim), std::string::npos) << text;
  EXPECT_NE(text.find("truncated"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(dir() + "/cut-out"));
  // Nothing left behind but the output's absence: no temporary sibling either.
  for (const auto& e : fs::directory_iterator(dir()))
    EXPECT_EQ(e.path().filename().string().find(".cut-out.tessera-tmp"), std::string::npos) << e.path();
}

TEST_F(DcpImport, ExistingOutputIsNotTouchedWithoutForce) {
  const std::string file = dir() + "/taken.txt";
  write_bytes(file, "keep me");
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + file);
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find("--force"), std::string::npos) << text;
  EXPECT_EQ(read_bytes(file), "keep me");
  // With --force, a file that is not a Tessera checkpoint is still not replaced.
  auto [rcf, textf] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + file + " --force");
  EXPECT_NE(rcf, 0) << textf;
  EXPECT_EQ(read_bytes(file), "keep me");
  // A Tessera checkpoint is replaced with --force (and only then).
  const std::string ckpt = dir() + "/again";
  auto [rc1, t1] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + ckpt);
  ASSERT_EQ(rc1, 0) << t1;
  const std::string before = read_bytes(ckpt + "/tessera-checkpoint.json");
  auto [rc2, t2] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + ckpt);
  EXPECT_NE(rc2, 0) << t2;
  EXPECT_EQ(read_bytes(ckpt + "/tessera-checkpoint.json"), before);
  auto [rc3, t3] = run_command(kCli + " ckpt import-dcp " + dcp() + " -o " + ckpt + " --force");
  EXPECT_EQ(rc3, 0) << t3;
}

// A value that is not plain Python data (a datetime.date) is an error naming the key,
// the file and the global; --skip-non-tensors leaves it out and says so.
TEST_F(DcpImport, NonPlainValueIsRefusedUnlessSkipped) {
  const std::string obj = src() + "/dcp_object";
  auto [rc, text] = run_command(kCli + " ckpt import-dcp " + obj + " -o " + dir() + "/obj");
  EXPECT_NE(rc, 0) << text;
  EXPECT_NE(text.find("the value of 'when' is not a plain Python value"), std::string::npos) << text;
  EXPECT_NE(text.find("datetime.date"), std::string::npos) << text;
  EXPECT_NE(text.find("--skip-non-tensors"), std::string::npos) << text;
  EXPECT_FALSE(fs::exists(dir() + "/obj"));
  auto [rcs, skip] = run_command(kCli + " ckpt import-dcp " + obj + " -o " + dir() + "/obj --skip-non-tensors");
  ASSERT_EQ(rcs, 0) << skip;
  EXPECT_NE(skip.find("skipped 'when'"), std::string::npos) << skip;
  auto [rci, inspect] = run_command(kCli + " ckpt inspect " + dir() + "/obj");
  ASSERT_EQ(rci, 0) << inspect;
  EXPECT_NE(inspect.find("step"), std::string::npos) << inspect;
  EXPECT_EQ(inspect.find("when"), std::string::npos) << inspect;
}

// A gpt run starts from weights a PyTorch 2.x model sharded by FSDP2 saved with dcp.save
// (tests/python/gpt_dcp_peer.py: the same architecture and parameter names, random weights;
// pos.weight's 17 rows shard unevenly): imported, then given to `gpt train --init-from`, its
// first loss is the loss Python computed with those weights on the same window.
TEST_F(DcpImport, GptStartsFromWeightsPythonSavedWithFsdp2) {
  const std::string gpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
  if (!fs::exists(gpt)) GTEST_SKIP() << gpt << " not built (examples disabled)";
  const std::string text = dir() + "/text.txt";
  std::string pattern;
  for (int i = 0; i < 800; ++i) pattern += "shard tensor ok!\n";  // 17 bytes = --seq-len: every window alike
  write_bytes(text, pattern);
  const std::string peer = std::string(TESSERA_SOURCE_DIR) + "/tests/python/gpt_dcp_peer.py";
  auto [rc, out] = run_command(kNoLauncherEnv + kCli + " run -n 2 -- " + kPython + " " + peer + " " + text + " " + dir() +
                               " 2 2 32 17");
  ASSERT_EQ(rc, 0) << out;
  const double want = std::stod(read_bytes(dir() + "/loss.txt"));
  auto [rci, imp] = run_command(kCli + " ckpt import-dcp " + dir() + "/dcp -o " + dir() + "/imported");
  ASSERT_EQ(rci, 0) << imp;
  auto [rcg, run] = run_command(kNoLauncherEnv + gpt + " train --strategy fsdp --devices 2 --init-from " + dir() +
                                "/imported --max-steps 1 --n-layer 2 --n-head 2 --d-model 32 --seq-len 17 " +
                                "--batch-size 8 --log-every 1 --val-every 0 --threads 1 --no-progress-bar --data " +
                                text + " --out " + dir() + "/run");
  ASSERT_EQ(rcg, 0) << run;
  EXPECT_NE(run.find("initial weights from"), std::string::npos) << run;
  // metrics.csv: step,epoch,lr,train_loss,...; the row of step 1.
  const std::string csv = read_bytes(dir() + "/run/metrics.csv");
  const size_t row = csv.find("\n1,");
  ASSERT_NE(row, std::string::npos) << csv;
  size_t at = row + 1;
  for (int comma = 0; comma < 3; ++comma) at = csv.find(',', at) + 1;
  const double got = std::stod(csv.substr(at));
  EXPECT_LE(std::abs(got - want), 1e-5 * std::abs(want)) << "gpt's first loss " << got << ", Python's " << want
                                                          << "\n" << csv;
}

#endif  // TESSERA_PYTHON_HAS_DCP
