// Programs started by an external launcher, with exactly the variables that launcher
// sets and nothing of tessera run's: real rank processes of the test worker and of the
// GPT example under Open MPI's variables (one host of 2 ranks; two hosts of 2 ranks,
// simulated on this machine), and Fabric's refusal to start ranks of its own inside a
// launcher's job of one process.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "support/build_paths.h"
#include "distributed/openmpi_env.h"
#include "support/child_process.h"
#include "support/test_util.h"

using namespace tessera::testing;
namespace fs = std::filesystem;

namespace {

const std::string kGpt = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";

bool is_launcher_var(const std::string& name) {
  static const char* const exact[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                      "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TESSERA_LAUNCHED",
                                      "TORCHELASTIC_USE_AGENT_STORE"};
  for (const char* e : exact)
    if (name == e) return true;
  return name.rfind("SLURM_", 0) == 0 || name.rfind("OMPI_", 0) == 0 || name.rfind("PMIX_", 0) == 0;
}

// Starts argv with this process's environment minus every launcher variable, plus `env`
// (in its own process group, output on a pipe: see Child).
Child spawn_clean(const std::vector<std::string>& argv_s, const std::map<std::string, std::string>& env) {
  return spawn(argv_s, env, is_launcher_var);
}

// mpirun's variables for one rank on this host, and what every rank of these tests runs with.
std::map<std::string, std::string> mpirun_env(int rank, int size, int per_node, int port) {
  auto env = openmpi_env(rank, size, per_node, "127.0.0.1", port);
  env["OMP_NUM_THREADS"] = "1";
  env["TESSERA_TEST_TIMEOUT_MS"] = "30000";
  return env;
}

struct Outcome {
  std::vector<int> codes;  // exit code per rank, -1: did not exit in time (killed)
  std::vector<std::string> text;
  std::string all() const {
    std::string s;
    for (size_t r = 0; r < text.size(); ++r) s += "--- rank " + std::to_string(r) + ":\n" + text[r] + "\n";
    return s;
  }
};

// Starts one process per environment and waits (bounded) for all of them.
Outcome run_all(const std::vector<std::string>& argv, const std::vector<std::map<std::string, std::string>>& envs,
                int timeout_ms) {
  std::vector<Child> procs;
  for (const auto& env : envs) procs.push_back(spawn_clean(argv, env));
  Outcome o;
  const int64_t end = steady_ms() + timeout_ms;
  for (auto& p : procs) {
    const int st = p.pid > 0 ? p.wait_exit(static_cast<int>(std::max<int64_t>(1, end - steady_ms()))) : -1;
    if (st == -1 && p.pid > 0) {
      ::kill(-p.pid, SIGKILL);
      p.wait_exit(10000);
    }
    o.codes.push_back(st == -1 ? -1 : (WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st)));
    o.text.push_back(p.text);
  }
  return o;
}

}  // namespace

// `mpirun -n 2 -x MASTER_ADDR -x MASTER_PORT tessera_test_worker world_info` on one host.
TEST(OpenMpiLaunch, OneHostOfTwoRanks) {
  const int port = free_port();
  auto o = run_all({TESSERA_WORKER, "world_info"}, {mpirun_env(0, 2, 2, port), mpirun_env(1, 2, 2, port)}, 60000);
  ASSERT_EQ(o.codes, (std::vector<int>{0, 0})) << o.all();
  EXPECT_NE(o.text[0].find("world rank 0/2 (local 0/2, node 0/1, from openmpi)"), std::string::npos) << o.all();
  EXPECT_NE(o.text[1].find("world rank 1/2 (local 1/2, node 0/1, from openmpi)"), std::string::npos) << o.all();
}

// `mpirun -n 4 --host a:2,b:2 ...`: two hosts of two ranks, simulated on this machine
// (each rank gets the variables it would get on its host).
TEST(OpenMpiLaunch, TwoHostsOfTwoRanks) {
  const int port = free_port();
  std::vector<std::map<std::string, std::string>> envs;
  for (int r = 0; r < 4; ++r) envs.push_back(mpirun_env(r, 4, 2, port));
  auto o = run_all({TESSERA_WORKER, "world_info"}, envs, 60000);
  ASSERT_EQ(o.codes, (std::vector<int>{0, 0, 0, 0})) << o.all();
  for (int r = 0; r < 4; ++r) {
    const std::string want = "world rank " + std::to_string(r) + "/4 (local " + std::to_string(r % 2) +
                             "/2, node " + std::to_string(r / 2) + "/2, from openmpi)";
    EXPECT_NE(o.text[r].find(want), std::string::npos) << want << "\n" << o.all();
    EXPECT_NE(o.text[r].find("world_info ok rank " + std::to_string(r)), std::string::npos) << o.all();
  }
}

// The GPT example under mpirun, without --devices: it takes the launcher's ranks.
TEST(OpenMpiLaunch, GptTrainsWithoutDevicesFlag) {
  if (!fs::exists(kGpt)) GTEST_SKIP() << kGpt << " not built (examples disabled)";
  const std::string dir = temp_dir("tessera-gpt-mpirun");
  std::ostringstream text;
  for (int i = 0; i < 800; ++i) text << (i % 7 == 0 ? "rank " : "shard ") << (i % 13 == 12 ? "\n" : "");
  write_bytes(dir + "/text.txt", text.str());
  const int port = free_port();
  std::vector<std::map<std::string, std::string>> envs{mpirun_env(0, 2, 2, port), mpirun_env(1, 2, 2, port)};
  auto o = run_all({kGpt, "train", "--strategy", "fsdp", "--max-steps", "2", "--data", dir + "/text.txt", "--out",
                    dir + "/run", "--n-layer", "1", "--n-head", "2", "--d-model", "16", "--seq-len", "8",
                    "--batch-size", "4", "--val-every", "0", "--log-every", "1", "--threads", "1",
                    "--no-progress-bar"},
                   envs, 120000);
  ASSERT_EQ(o.codes, (std::vector<int>{0, 0})) << o.all();
  EXPECT_TRUE(fs::exists(dir + "/run/metrics.csv")) << o.all();
  EXPECT_TRUE(fs::exists(dir + "/run/checkpoints/last.ckpt")) << o.all();
}

// mpirun -n 1 (a launcher's job of one process) with FabricOptions.devices = 2: Fabric
// must not start 2 ranks of its own inside the launcher's job; it says so, naming the
// launcher.
TEST(OpenMpiLaunch, FabricDoesNotSelfLaunchInsideALaunchersJob) {
  auto env = mpirun_env(0, 1, 1, free_port());
  auto o = run_all({TESSERA_WORKER, "fabric_selfspawn", "2", "0"}, {env}, 60000);
  EXPECT_NE(o.codes[0], 0) << o.all();
  EXPECT_NE(o.text[0].find("started by a launcher (openmpi) with a world size of 1 but FabricOptions.devices=2"),
            std::string::npos)
      << o.all();
  EXPECT_EQ(o.text[0].find("selfspawn rank"), std::string::npos) << "ranks were started:\n" << o.all();
}

// Fabric's own launch (no launcher, devices = 2) reports the failing rank in one line,
// like `tessera run`.
TEST(FabricSelfLaunch, FailingRankIsReportedOnce) {
  auto o = run_all({TESSERA_WORKER, "fabric_selfspawn", "2", "7"}, {{{"TESSERA_TEST_TIMEOUT_MS", "20000"}}}, 60000);
  EXPECT_EQ(o.codes[0], 7) << o.all();
  size_t reports = 0;
  for (size_t p = o.text[0].find("rank 1 (pid"); p != std::string::npos; p = o.text[0].find("rank 1 (pid", p + 1))
    ++reports;
  EXPECT_EQ(reports, 1u) << o.all();
  EXPECT_NE(o.text[0].find("exited with code 7"), std::string::npos) << o.all();
}
