// Packaging: `cmake --install` into a fresh prefix, then a tiny out-of-tree project
// does find_package(Tessera), links Tessera::tessera, builds and runs on 2 ranks.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/test_util.h"

namespace fs = std::filesystem;

using tessera::testing::run_command;

TEST(Install, OutOfTreeConsumerFindsAndLinksTessera) {
  const fs::path tmp = tessera::testing::temp_dir("tessera-install");
  const std::string prefix = (tmp / "prefix").string();
  auto [rc, out] = run_command("cmake --install " TESSERA_BINARY_DIR " --prefix " + prefix);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(fs::exists(tmp / "prefix/bin/tessera"));
  EXPECT_TRUE(fs::exists(tmp / "prefix/include/tessera/distributed/communicator.h"));
  EXPECT_TRUE(fs::exists(tmp / "prefix/include/tessera/config.h"));
  EXPECT_FALSE(fs::exists(tmp / "prefix/include/tessera/core/pch.h"));
  const std::string build = (tmp / "consumer-build").string();
  std::tie(rc, out) = run_command("cmake -S " TESSERA_SOURCE_DIR "/tests/tools/consumer -B " + build + " -G Ninja '-DCMAKE_PREFIX_PATH=" +
                         prefix + ";" TESSERA_TORCH_ROOT "' " TESSERA_CONSUMER_CMAKE_ARGS);
  ASSERT_EQ(rc, 0) << out;
  std::tie(rc, out) = run_command("cmake --build " + build);
  ASSERT_EQ(rc, 0) << out;
  std::tie(rc, out) = run_command(prefix + "/bin/tessera run -n 2 -- " + build + "/consumer");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[rank 1] consumer ok: world 2 sum 6 chunks 4"), std::string::npos) << out;
}
