// Reliability: crash consistency of saves. `tessera run -n 2` runs a save loop
// (sharded, and consolidated; synchronous saves, and async ones written by a background
// thread while the next iteration is prepared) that is SIGKILLed at a seeded random moment — the whole
// job at once (power loss) or one rank (the launcher then stops the other). After each
// kill the path must hold one complete iteration that `tessera ckpt verify` accepts and
// that loads; leftovers of the interrupted save are ignored by readers and removed by
// the next completed save. TESSERA_SOAK=1: 120 kills instead of 4.
#include <dirent.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <set>
#include <thread>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;

namespace {

// Direct children of `parent` (from /proc).
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string n = e.path().filename().string();
    if (n.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream f(e.path() / "stat");
    std::string line;
    if (!std::getline(f, line)) continue;
    const size_t rp = line.rfind(')');
    if (rp == std::string::npos) continue;
    std::istringstream rest(line.substr(rp + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stol(n)));
  }
  return out;
}

// Siblings the save machinery leaves next to `path` (".<name>.tessera-tmp-*", "-old-*").
std::vector<std::string> leftovers(const std::string& path) {
  std::vector<std::string> out;
  const fs::path p(path);
  const std::string prefix = "." + p.filename().string() + ".tessera-";
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
  return out;
}

}  // namespace

// `rounds` kills of `ranks`-rank save loops (ckpt_save_loop; `two_d`: its 2-D form, on 4
// ranks), each followed by the checks above.
static void crash_rounds(const std::string& dir, int rounds, int ranks, bool two_d) {
  const uint64_t seed0 = base_seed();
  std::set<long> iterations;
  int kills = 0, whole_job = 0, one_rank = 0, leftover_seen = 0;
  std::vector<int64_t> delays;
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    const uint64_t seed = seed0 + static_cast<uint64_t>(round);
    std::mt19937_64 rng(seed);
    // 2-D states are saved sharded (a 2-D job's consolidated save is its plain tensors).
    const bool full = !two_d && round % 3 == 2, async = round % 4 >= 2;
    const std::string target = full ? dir + "/full.safetensors" : dir + "/ckpt";
    const std::string where = "round " + std::to_string(round) + " seed " + std::to_string(seed) +
                              (full ? " (consolidated" : " (sharded") + (async ? ", async)" : ")");
    Child job = spawn({TESSERA_CLI, "run", "-n", std::to_string(ranks), "--", TESSERA_WORKER, "ckpt_save_loop", target,
                       full ? "full" : "sharded", async ? "async" : "sync", two_d ? "2d" : "1d"});
    ASSERT_GT(job.pid, 0);
    // The first save of this job committed: from here on every moment is a fair target.
    const bool started = job.wait_for("saved 1\n", 60000);
    if (!started) {
      ::kill(-job.pid, SIGKILL);
      job.wait_exit(10000);
      FAIL() << where << ": the save loop did not start:\n" << job.text;
    }
    const int64_t delay_us = std::uniform_int_distribution<int64_t>(0, 400000)(rng);
    delays.push_back(delay_us);
    const bool kill_job = std::uniform_int_distribution<int>(0, 1)(rng) == 0;
    const int64_t t_end = steady_ms() + delay_us / 1000;
    while (steady_ms() < t_end) job.pump(static_cast<int>(std::max<int64_t>(1, t_end - steady_ms())));
    if (kill_job) {
      ::kill(-job.pid, SIGKILL);  // launcher and both ranks at once
      ++whole_job;
    } else {
      auto ranks = children_of(job.pid);
      ASSERT_FALSE(ranks.empty()) << where;
      ::kill(ranks[std::uniform_int_distribution<size_t>(0, ranks.size() - 1)(rng)], SIGKILL);
      ++one_rank;
    }
    const int st = job.wait_exit(60000);
    ASSERT_NE(st, -1) << where << ": the job did not end after the kill";
    // Nothing of the job may survive it (the launcher stops the other rank; PDEATHSIG).
    for (int i = 0; i < 100 && group_alive(job.pid); ++i) ::usleep(50000);
    EXPECT_FALSE(group_alive(job.pid)) << where << ": processes of the job outlived it";
    ++kills;
    leftover_seen += leftovers(target).empty() ? 0 : 1;

    auto [rc, out] = run_command(std::string(TESSERA_CLI) + " ckpt verify " + target);
    EXPECT_EQ(rc, 0) << where << ": tessera ckpt verify rejects the checkpoint left by the kill\n" << out;
    auto v = run_ranks(1, {"ckpt_verify_iter", target}, 60);
    ASSERT_EQ(v.launch.exit_code, 0) << where << ": the checkpoint does not load as one whole iteration\n"
                                     << v.all_output();
    ASSERT_FALSE(v.out[0].empty());
    iterations.insert(std::stol(v.out[0].back().substr(10)));
    if (soak()) std::cout << "[crash] " << where << ": ok" << std::endl;  // progress of long runs
  }
  // A completed save to each path removes every leftover of the interrupted ones.
  for (const std::string& target : {dir + "/ckpt", dir + "/full.safetensors"}) {
    if (!fs::exists(target)) continue;
    auto s = run_ranks(2, {"ckpt_save", target, target.find("full") != std::string::npos ? "full" : "sharded", "sharded"}, 120);
    ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
    EXPECT_TRUE(leftovers(target).empty()) << target << " still has leftovers: " << leftovers(target)[0];
    EXPECT_TRUE(ck::verify(target).ok);
  }
  std::cout << "[crash] kills " << kills << " (whole job " << whole_job << ", one rank " << one_rank
            << "), iterations seen " << iterations.size() << ", kills that left leftovers " << leftover_seen
            << std::endl;
  EXPECT_EQ(kills, rounds);
  EXPECT_GT(iterations.size(), 1u);  // the kills landed at different moments of the loop
}

TEST(ReliabilityCrash, SigkillAtRandomMomentsOfMultiRankSavesLeavesACompleteCheckpoint) {
  crash_rounds(temp_dir("tessera-rel-crash"), scaled(4, 120), 2, false);
}

// The same for 2-D saves (issue 47): 4 ranks as (dp 2, tp 2), the state holding a tp rule
// (a fused weight in 3 stripes, FSDP's flat cut of each TP piece) and a parameter replicated
// over tp whose dp groups interleave in the world (format version 3).
TEST(ReliabilityCrash, SigkillDuringTwoDimensionalSavesLeavesACompleteCheckpoint) {
  crash_rounds(temp_dir("tessera-rel-crash-2d"), scaled(4, 60), 4, true);
}
