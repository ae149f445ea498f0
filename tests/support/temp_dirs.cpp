// Disposes of the temporary directories each test made through test_util.h's temp_dir():
// removed when the test ends without failing (passed or skipped), kept for a post-mortem
// and named on stderr when it failed. Installed by a static initializer, as the binary's
// main() is gtest_main's. A test that crashes never reaches OnTestEnd: its directories stay.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>

#include "support/test_util.h"

namespace {

class TempDirListener : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    const bool failed = info.result()->Failed();
    for (const std::string& path : tessera::testing::take_temp_dirs()) {
      std::error_code ec;
      if (!failed) {
        std::filesystem::remove_all(path, ec);  // best effort: errors ignored
      } else if (std::filesystem::exists(path, ec)) {
        std::cerr << "kept for post-mortem: " << path << std::endl;
      }
    }
  }
};

[[maybe_unused]] const bool installed = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new TempDirListener);
  return true;
}();

}  // namespace
