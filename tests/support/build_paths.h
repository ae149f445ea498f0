#pragma once
#include <string>

// Where this build put the programs the tests start (the rank worker, the CLI), the source
// and build folders, the tests' Python, and what an out-of-tree consumer needs to find the
// same libtorch.
//
// They are defined in one file generated at configure time (tests/CMakeLists.txt writes
// generated/tessera_tests/build_paths.cpp) rather than passed as compile definitions: with
// definitions every test object's compile line held the checkout's absolute path, so a fresh
// clone (CI's) missed ccache for every test file and compiled the suite cold twice (Debian and
// torch 2.x builds). Now only that one generated file depends on where the checkout is.
namespace tessera::testing::build_paths {
const char* worker();               // bin/tessera_test_worker
const char* cli();                  // bin/tessera
const char* source_dir();           // the project's root
const char* binary_dir();           // this build folder
const char* python();               // the Python the tests check files with
const char* consumer_cmake_args();  // -DTorch_DIR=... for tests/tools/consumer
const char* torch_root();           // the libtorch root (its lib/ folder's parent)
}  // namespace tessera::testing::build_paths

#define TESSERA_WORKER (::tessera::testing::build_paths::worker())
#define TESSERA_CLI (::tessera::testing::build_paths::cli())
#define TESSERA_SOURCE_DIR (::tessera::testing::build_paths::source_dir())
#define TESSERA_BINARY_DIR (::tessera::testing::build_paths::binary_dir())
#define TESSERA_PYTHON (::tessera::testing::build_paths::python())
#define TESSERA_CONSUMER_CMAKE_ARGS (::tessera::testing::build_paths::consumer_cmake_args())
#define TESSERA_TORCH_ROOT (::tessera::testing::build_paths::torch_root())

namespace tessera::testing {
// Shell commands the tests run through run_command: the CLI with `args`, and one of
// tests/python's scripts under the tests' Python.
inline std::string cli(const std::string& args) { return std::string(TESSERA_CLI) + " " + args; }
inline std::string py(const std::string& script_and_args) {
  return std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR + "/tests/python/" + script_and_args;
}
}  // namespace tessera::testing
