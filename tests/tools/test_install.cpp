// Packaging: `cmake --install` into a fresh prefix (one archive per layer, public headers
// only), then a tiny out-of-tree project does find_package(Tessera), links
// Tessera::tessera, builds and runs on 2 ranks.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "support/build_paths.h"
#include "support/test_util.h"
#include "tessera/config.h"

namespace fs = std::filesystem;

using tessera::testing::run_command;

TEST(Install, OutOfTreeConsumerFindsAndLinksTessera) {
  const fs::path tmp = tessera::testing::temp_dir("tessera-install");
  const std::string prefix = (tmp / "prefix").string();
  auto [rc, out] = run_command(std::string("cmake --install ") + TESSERA_BINARY_DIR + " --prefix " + prefix);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(fs::exists(tmp / "prefix/bin/tessera"));
  EXPECT_TRUE(fs::exists(tmp / "prefix/include/tessera/distributed/communicator.h"));
  EXPECT_TRUE(fs::exists(tmp / "prefix/include/tessera/config.h"));
  // Public headers only: the internal ones (src/CMakeLists.txt) stay behind.
  for (const char* internal : {"core/pch.h", "strategy/fsdp_impl.h", "strategy/grad_hooks.h",
                               "distributed/shm_channel.h", "distributed/c10d_routes.h", "checkpoint/interop/pickle_reader.h",
                               "trainer/rng_state.h"})
    EXPECT_FALSE(fs::exists(tmp / "prefix/include/tessera" / internal)) << internal;
  for (const char* lib : {"libtessera_core.a", "libtessera_checkpoint.a", "libtessera_trainer.a"})
    EXPECT_TRUE(fs::exists(tmp / "prefix/lib" / lib) || fs::exists(tmp / "prefix/lib64" / lib)) << lib;
  const std::string build = (tmp / "consumer-build").string();
  std::tie(rc, out) = run_command(std::string("cmake -S ") + TESSERA_SOURCE_DIR + "/tests/tools/consumer -B " + build +
                                  " -G Ninja '-DCMAKE_PREFIX_PATH=" + prefix + ";" + TESSERA_TORCH_ROOT + "' " +
                                  TESSERA_CONSUMER_CMAKE_ARGS);
  ASSERT_EQ(rc, 0) << out;
  std::tie(rc, out) = run_command("cmake --build " + build);
  ASSERT_EQ(rc, 0) << out;
  std::tie(rc, out) = run_command(prefix + "/bin/tessera run -n 2 -- " + build + "/consumer");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[rank 1] consumer ok: world 2 sum 6 chunks 4"), std::string::npos) << out;

  // A tool that links one layer (Tessera::tessera_checkpoint) builds and saves and loads
  // through a Communicator.
  std::tie(rc, out) = run_command(build + "/ckpt_tool " + (tmp / "ckpt").string());
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("ckpt_tool ok: sum 15"), std::string::npos) << out;
  // The layers take libtorch's CUDA libraries only as needed: the installed CLI (the
  // checkpoint layer's offline tools and the launcher, no Communicator) does not load
  // them; a program linking Tessera::tessera does (on a CUDA build of libtorch).
  std::tie(rc, out) = run_command("ldd " + prefix + "/bin/tessera");
  EXPECT_EQ(out.find("libtorch_cuda"), std::string::npos) << out;
#if TESSERA_HAS_CUDA
  std::tie(rc, out) = run_command("ldd " + build + "/consumer");
  EXPECT_NE(out.find("libtorch_cuda"), std::string::npos) << out;
#endif
}
