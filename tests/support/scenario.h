// Scenarios of the test worker: rank programs started by the multi-process tests
// through the launcher. A scenario returns the process exit code; failed checks throw.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/communicator.h"

namespace tessera::testing {

struct ScenarioArgs {
  std::vector<std::string> args;  // after the scenario name
  std::string arg(size_t i, const std::string& def = "") const { return i < args.size() ? args[i] : def; }
  int64_t int_arg(size_t i, int64_t def = 0) const { return i < args.size() ? std::stoll(args[i]) : def; }
  // Argument i (or `def`) split at its commas: "ddp,fsdp" -> {"ddp", "fsdp"}.
  std::vector<std::string> list_arg(size_t i, const std::string& def = "") const {
    std::vector<std::string> out;
    std::string item;
    for (char c : arg(i, def) + ",") {
      if (c != ',') {
        item += c;
      } else if (!item.empty()) {
        out.push_back(item);
        item.clear();
      }
    }
    return out;
  }
};

using ScenarioFn = std::function<int(const ScenarioArgs&)>;
std::map<std::string, ScenarioFn>& scenarios();

struct Register {
  Register(const std::string& name, ScenarioFn fn) { scenarios()[name] = std::move(fn); }
};

// The communicator for this process, created from the environment on first use with
// the timeout in TESSERA_TEST_TIMEOUT_MS (default 30000).
std::shared_ptr<distributed::Communicator> comm();

}  // namespace tessera::testing

#define TESSERA_CAT2(a, b) a##b
#define TESSERA_CAT(a, b) TESSERA_CAT2(a, b)
#define SCENARIO(name)                                                                  \
  static int TESSERA_CAT(scenario_fn_, __LINE__)(const ::tessera::testing::ScenarioArgs&); \
  static ::tessera::testing::Register TESSERA_CAT(scenario_reg_, __LINE__)(              \
      name, TESSERA_CAT(scenario_fn_, __LINE__));                                        \
  static int TESSERA_CAT(scenario_fn_, __LINE__)(const ::tessera::testing::ScenarioArgs& args)

// EXPECT-style check for scenarios: throws with the location and message.
#define WCHECK(cond, ...) TESSERA_CHECK(cond, __FILE__, ":", __LINE__, ": check failed: " #cond " ", __VA_ARGS__)
