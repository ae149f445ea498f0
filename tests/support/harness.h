// Starts real rank processes of the test worker through the launcher and collects
// what each printed and how each ended. Time-bounded; ports chosen free.
#pragma once
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "tessera/distributed/launch/launcher.h"

namespace tessera::testing {

struct RanksResult {
  distributed::LaunchResult launch;
  std::map<int, std::vector<std::string>> out, err;
  std::string all_output() const {
    std::string s;
    for (auto& [r, lines] : out)
      for (auto& l : lines) s += "[rank " + std::to_string(r) + "] " + l + "\n";
    for (auto& [r, lines] : err)
      for (auto& l : lines) s += "[rank " + std::to_string(r) + " err] " + l + "\n";
    return s;
  }
};

inline RanksResult run_ranks(int n, const std::vector<std::string>& worker_args, int deadline_s = 120,
                             std::map<std::string, std::string> env = {}, int grace_ms = 3000,
                             int max_restarts = 0) {
  RanksResult res;
  std::mutex mu;
  distributed::LaunchOptions o;
  o.command = {TESSERA_WORKER};
  for (auto& a : worker_args) o.command.push_back(a);
  o.nproc_per_node = n;
  o.env = std::move(env);
  o.deadline = std::chrono::seconds(deadline_s);
  o.grace = std::chrono::milliseconds(grace_ms);
  o.forward_signals = false;
  o.max_restarts = max_restarts;
  o.on_line = [&](int rank, bool is_err, const std::string& line) {
    std::lock_guard<std::mutex> lock(mu);
    (is_err ? res.err : res.out)[rank].push_back(line);
  };
  res.launch = distributed::launch(o);
  return res;
}

// Asserts that every rank exited 0.
#define EXPECT_RANKS_OK(res) \
  EXPECT_EQ((res).launch.exit_code, 0) << (res).launch.message << "\n" << (res).all_output()

}  // namespace tessera::testing
