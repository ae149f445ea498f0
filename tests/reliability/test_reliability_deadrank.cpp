// Reliability: a rank SIGKILLed in the middle of forward, backward, a collective or a
// save of an FSDP training run (tests/reliability/reliability_scenarios.cpp, rel_train).
//  - Without a launcher (each rank started on its own, so nothing but the library can
//    stop the survivors): every other rank exits non-zero with an error within the
//    configured timeout, no process is left, and the last committed checkpoint still
//    verifies and loads.
//  - Through `tessera run`: the launcher exits non-zero naming the dead rank and leaves
//    no process behind.
// Prints the time from the death to each survivor's exit ("[deadrank] ..." lines).
#include <gtest/gtest.h>

#include <iostream>
#include <random>
#include <regex>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera;
using namespace tessera::testing;
namespace ck = tessera::checkpoint;

namespace {

constexpr int kWorld = 3;
constexpr int kTimeoutMs = 5000;  // the Communicator timeout given to the ranks

struct DeadRankCase {
  const char* phase;
  int victim;
  bool shm;  // collectives over the shared-memory channel (the default on one host), or Gloo
};

std::string transport(bool shm) { return shm ? "shm" : "gloo"; }

// The environment of rank r of a job started without a launcher (torchrun's variables).
// TESSERA_SHM=0 sends the collectives over Gloo, the path between hosts.
std::map<std::string, std::string> rank_env(int r, int port, bool shm) {
  return {{"TESSERA_SHM", shm ? "1" : "0"},
          {"RANK", std::to_string(r)},
          {"LOCAL_RANK", std::to_string(r)},
          {"WORLD_SIZE", std::to_string(kWorld)},
          {"LOCAL_WORLD_SIZE", std::to_string(kWorld)},
          {"GROUP_RANK", "0"},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"OMP_NUM_THREADS", "1"},
          {"TESSERA_TEST_TIMEOUT_MS", std::to_string(kTimeoutMs)}};
}

void print_output(const std::vector<Child>& ranks) {
  for (size_t r = 0; r < ranks.size(); ++r) std::cerr << "--- rank " << r << ":\n" << ranks[r].text << "\n";
}

}  // namespace

class ReliabilityDeadRank : public ::testing::TestWithParam<DeadRankCase> {};

TEST_P(ReliabilityDeadRank, SurvivorsFailWithinTheTimeoutAndTheLastCheckpointLoads) {
  const auto [phase, victim, shm] = GetParam();
  const std::string dir = temp_dir("tessera-rel-dead");
  const uint64_t seed = base_seed() + static_cast<uint64_t>(victim);
  const int port = free_port();
  std::vector<Child> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.push_back(spawn({TESSERA_WORKER, "rel_train", phase, std::to_string(victim), dir, "6", std::to_string(seed)},
                          rank_env(r, port, shm)));
    ASSERT_GT(ranks.back().pid, 0);
  }
  // The victim dies by SIGKILL (bounded wait: start-up and 4 steps).
  const int vst = ranks[victim].wait_exit(120000);
  if (vst == -1) {
    for (auto& c : ranks) ::kill(-c.pid, SIGKILL);
    for (auto& c : ranks) c.wait_exit(10000);
    print_output(ranks);
    FAIL() << phase << ": the victim did not die";
  }
  const int64_t t_dead = steady_ms();
  ASSERT_TRUE(WIFSIGNALED(vst) && WTERMSIG(vst) == SIGKILL) << phase << ": victim status " << vst << "\n"
                                                          << ranks[victim].text;
  EXPECT_NE(ranks[victim].text.find(std::string("victim dies in ") + phase), std::string::npos)
      << ranks[victim].text;
  EXPECT_NE(ranks[victim].text.find("transport " + transport(shm)), std::string::npos) << ranks[victim].text;
  std::string figures;
  for (int r = 0; r < kWorld; ++r) {
    if (r == victim) continue;
    const int st = ranks[r].wait_exit(kTimeoutMs + 30000);
    const int64_t dt = steady_ms() - t_dead;
    if (st == -1) ::kill(-ranks[r].pid, SIGKILL), ranks[r].wait_exit(10000);
    ASSERT_NE(st, -1) << phase << ": rank " << r << " still runs " << dt << " ms after rank " << victim
                      << " died (hang)\n" << ranks[r].text;
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << phase << ": rank " << r << " status " << st << "\n"
                                                       << ranks[r].text;
    // Survivors report an error naming what failed, not a crash.
    EXPECT_TRUE(ranks[r].text.find("CommError") != std::string::npos ||
                ranks[r].text.find("FAILED") != std::string::npos)
        << ranks[r].text;
    // Within the configured timeout (plus start-up slack of a loaded 2-core machine).
    EXPECT_LE(dt, kTimeoutMs + 5000) << phase << ": rank " << r << " took " << dt << " ms to exit";
    figures += " rank " + std::to_string(r) + " " + std::to_string(dt) + " ms (exit " +
               std::to_string(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st)) + ")";
  }
  for (auto& c : ranks) EXPECT_FALSE(group_alive(c.pid)) << phase << ": a process of rank pid " << c.pid << " is left";
  std::cout << "[deadrank] " << phase << " (" << transport(shm) << "): rank " << victim << " killed; time to exit:" << figures << std::endl;

  // The last committed checkpoint: step 2, or step 4 when the killed save had committed.
  auto [rc, out] = run_command(std::string(TESSERA_CLI) + " ckpt verify " + dir + "/ckpt");
  EXPECT_EQ(rc, 0) << out;
  auto l = run_ranks(1, {"rel_load", dir + "/ckpt"}, 120);
  ASSERT_EQ(l.launch.exit_code, 0) << l.all_output();
  const std::string last = l.out[0].empty() ? "" : l.out[0].back();
  EXPECT_TRUE(last == "loaded step 2" || (std::string(phase) == "save" && last == "loaded step 4")) << last;
}

INSTANTIATE_TEST_SUITE_P(Phases, ReliabilityDeadRank,
                         ::testing::Values(DeadRankCase{"forward", 1, true}, DeadRankCase{"backward", 2, true},
                                           DeadRankCase{"collective", 0, true}, DeadRankCase{"save", 1, true},
                                           DeadRankCase{"forward", 1, false}, DeadRankCase{"backward", 2, false},
                                           DeadRankCase{"collective", 0, false}, DeadRankCase{"save", 1, false}),
                         [](const auto& info) {
                           return std::string(info.param.phase) + (info.param.shm ? "" : "_gloo");
                         });

// A rank that stops (SIGSTOP inside a collective) instead of dying keeps its sockets
// open: only the Communicator timeout can end the survivors' wait. They must exit with
// an error after about the timeout, not hang, naming the collective (its number in the
// communicator, size and dtype), the group size, the timeout and the stopped rank as the
// one that had not arrived, and not themselves (distributed/arrivals.h).
class ReliabilityDeadRankFrozen : public ::testing::TestWithParam<bool> {};

TEST_P(ReliabilityDeadRankFrozen, SurvivorsOfAStoppedRankFailAfterTheTimeout) {
  const bool shm = GetParam();
  const std::string dir = temp_dir("tessera-rel-frozen");
  const int port = free_port();
  const int victim = 1;
  std::vector<Child> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.push_back(spawn({TESSERA_WORKER, "rel_train", "freeze", std::to_string(victim), dir, "6"},
                          rank_env(r, port, shm)));
    ASSERT_GT(ranks.back().pid, 0);
  }
  const bool froze = ranks[victim].wait_for("victim freezes in collective", 120000);
  const int64_t t_frozen = steady_ms();
  std::string figures;
  for (int r = 0; froze && r < kWorld; ++r) {
    if (r == victim) continue;
    const int st = ranks[r].wait_exit(kTimeoutMs + 30000);
    const int64_t dt = steady_ms() - t_frozen;
    if (st == -1) ::kill(-ranks[r].pid, SIGKILL), ranks[r].wait_exit(10000);
    EXPECT_NE(st, -1) << "rank " << r << " still waits " << dt << " ms after rank " << victim << " froze (hang)";
    if (st == -1) continue;
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << "rank " << r << " status " << st << "\n" << ranks[r].text;
    EXPECT_NE(ranks[r].text.find("CommError"), std::string::npos) << ranks[r].text;
    // "all_reduce #25 (Float [2097152], 2097152 elements, 8 MiB) in a group of 3 on rank 0
    // timed out after 5 s: rank 1 had not arrived (2 of 3 ranks were waiting in it) [...]"
    std::smatch m;
    const std::regex timed_out("(all_reduce|all_gather|reduce_scatter|broadcast|all_to_all) #[0-9]+ "
                               "\\((Float|Long|Int) \\[[0-9, ]*\\], [0-9]+ elements, [^)]+\\) in a group of 3 on rank " +
                               std::to_string(r) + " timed out after 5 s: ([^:\\[]*) had not arrived");
    const bool named = std::regex_search(ranks[r].text, m, timed_out);
    EXPECT_TRUE(named) << ranks[r].text;
    if (named) EXPECT_EQ(m[3].str(), "rank " + std::to_string(victim)) << ranks[r].text;  // not the survivors
    EXPECT_LE(dt, kTimeoutMs + 5000) << "rank " << r << " took " << dt << " ms to exit";
    figures += " rank " + std::to_string(r) + " " + std::to_string(dt) + " ms";
  }
  ::kill(-ranks[victim].pid, SIGKILL);
  ranks[victim].wait_exit(10000);
  ASSERT_TRUE(froze) << ranks[victim].text;
  EXPECT_NE(ranks[victim].text.find("transport " + transport(shm)), std::string::npos) << ranks[victim].text;
  for (auto& c : ranks) EXPECT_FALSE(group_alive(c.pid));
  std::cout << "[deadrank] freeze (SIGSTOP) in a collective (" << transport(shm) << "), timeout " << kTimeoutMs
            << " ms: time to exit:" << figures << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Transports, ReliabilityDeadRankFrozen, ::testing::Values(true, false),
                         [](const auto& info) { return transport(info.param); });

// Through the launcher: non-zero exit naming the rank, nothing left behind.
TEST(ReliabilityDeadRankLauncher, TesseraRunExitsNonZeroNamingTheDeadRank) {
  const std::string dir = temp_dir("tessera-rel-dead");
  const int64_t t0 = steady_ms();
  Child job = spawn({TESSERA_CLI, "run", "-n", "3", "--grace", "2", "--", TESSERA_WORKER, "rel_train", "collective",
                     "2", dir, "6"},
                    {{"TESSERA_TEST_TIMEOUT_MS", std::to_string(kTimeoutMs)}});
  ASSERT_GT(job.pid, 0);
  ASSERT_TRUE(job.wait_for("victim dies in collective", 120000)) << job.text;
  const int64_t t_dead = steady_ms();
  const int st = job.wait_exit(60000);
  if (st == -1) ::kill(-job.pid, SIGKILL), job.wait_exit(10000);
  ASSERT_NE(st, -1) << "tessera run did not exit after a rank died\n" << job.text;
  const int64_t dt = steady_ms() - t_dead;
  ASSERT_TRUE(WIFEXITED(st));
  EXPECT_EQ(WEXITSTATUS(st), 128 + SIGKILL) << job.text;
  EXPECT_NE(job.text.find("rank 2"), std::string::npos) << job.text;
  for (int i = 0; i < 40 && group_alive(job.pid); ++i) ::usleep(50000);
  EXPECT_FALSE(group_alive(job.pid)) << "processes of the job outlived tessera run";
  std::cout << "[deadrank] tessera run -n 3, rank 2 killed in a collective: launcher exited " << WEXITSTATUS(st)
            << " after " << dt << " ms (run total " << steady_ms() - t0 << " ms)" << std::endl;
  auto [rc, out] = run_command(std::string(TESSERA_CLI) + " ckpt verify " + dir + "/ckpt");
  EXPECT_EQ(rc, 0) << out;
}
