// Tessera's files read by the real Python readers from the project's environment
// (scripts/setup-python.sh): every data file of a sharded checkpoint and a consolidated
// file opened by the `safetensors` library and checked value for value.
#include <gtest/gtest.h>

#include <string>

#include "support/build_paths.h"
#include "checkpoint/checkpoint_test_util.h"
#include "support/harness.h"
#include "support/test_util.h"

using namespace tessera::testing;

namespace {


}  // namespace

TEST(PythonReaders, SafetensorsLibraryReadsEveryShardOfASavedCheckpoint) {
  const std::string dir = temp_dir("tessera-pyread");
  // Three ranks: uneven pieces (7 rows over 3), a rank with an empty piece of model.e.
  auto r = run_ranks(3, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  downgrade_to_v1(dir + "/ckpt");  // the script follows version 1's chunk lists by hand
  auto [rc, out] = run_command(py("checkpoint_read_sharded.py " + dir + "/ckpt"));
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ok 8"), std::string::npos) << out;

  // The same state consolidated offline: one file the library reads whole.
  auto [crc, cout_] = run_command(std::string(TESSERA_CLI) + " ckpt consolidate " + dir + "/ckpt -o " + dir +
                                  "/full.safetensors");
  ASSERT_EQ(crc, 0) << cout_;
  auto [rc2, out2] = run_command(py("checkpoint_read_export.py --safetensors-only " + dir + "/full.safetensors"));
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("ok 8"), std::string::npos) << out2;
}

TEST(PythonReaders, SafetensorsLibraryRejectsATruncatedDataFile) {
  // The check above could pass with a reader that accepts anything: make sure it does not.
  const std::string dir = temp_dir("tessera-pyread");
  auto r = run_ranks(2, {"ckpt_save", dir + "/ckpt", "sharded", "sharded"}, 120);
  ASSERT_EQ(r.launch.exit_code, 0) << r.all_output();
  const std::string f = dir + "/ckpt/data-rank00000.safetensors";
  std::string bytes = read_bytes(f);
  ASSERT_GT(bytes.size(), 16u);
  write_bytes(f, bytes.substr(0, bytes.size() - 4));
  auto [rc, out] = run_command(py("checkpoint_read_sharded.py " + dir + "/ckpt"));
  EXPECT_NE(rc, 0) << out;
}
