// The chaos test (issue 34, items 4 and 5), short form of bench/faults: a 2-rank tiny GPT
// under `tessera run -n 2 --max-restarts K -- gpt train --resume auto --ckpt-every 4
// --comm-timeout 3`, hit at seeded random moments by one SIGKILL, one SIGSEGV and one
// SIGSTOP of random ranks (bench/faults/chaos.py injects them and measures; the same
// driver runs the benchmark's 20 failures). The job must end by itself with exit 0, and:
//  - the final model and optimizer state (every tensor, and every plain value: steps, RNG
//    states, loop and callback state) is bit-identical to an uninterrupted run of the same
//    command: compared here through the checkpoint library (both consolidated, read back
//    tensor by tensor), independently of the driver's own byte comparison of the shards;
//  - each failure lost at most the checkpoint interval S of work (sync saves) or 2*S
//    (async: the newest save may still be in flight while S more steps run; the save
//    after it waits for it), counted from the last step the job had logged to the step
//    it resumed from;
//  - nothing is left behind, after each restart and at the end: no process of the job
//    (the driver marks the job's environment and scans /proc), no /dev/shm/tessera-<pid>-*
//    segment of any of its ranks, no ".*tessera-tmp*" entry in the run directory, and
//    run.lock not held (the empty file stays by design: it is an fcntl lock the kernel
//    drops with its process; a leftover file is harmless, the next run locks it).
// With synchronous and with --async-ckpt saves on one node, and with synchronous saves on
// two nodes (one `tessera run --nnodes 2` per node, one rank each, on this host: a failure
// on either node restarts both, through node 0's store). The seed is printed (TESSERA_SEED
// picks it); TESSERA_SOAK=1 injects 12 failures instead of 3. The launcher's --grace is
// 1 s here (a SIGSTOPped rank takes the launcher's SIGTERM at once since it follows it
// with SIGCONT; the grace bounds anything slower to end).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/test_util.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera::testing;
namespace ck = tessera::checkpoint;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::string kGptBin = std::string(TESSERA_BINARY_DIR) + "/bin/gpt";
const std::string kDriver = std::string(TESSERA_SOURCE_DIR) + "/bench/faults/chaos.py";
const std::string kPython = "/usr/bin/python3";

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

// Both final checkpoints consolidated with the library and compared: the same tensors
// (names, dtypes, shapes) with the same bytes, and the same plain values once each run's
// own directory is replaced by "<OUT>". Returns the number of tensors compared.
size_t expect_same_final_state(const std::string& clean_run, const std::string& chaos_run, const std::string& tmp) {
  const std::string a_path = tmp + "/clean.safetensors", b_path = tmp + "/chaos.safetensors";
  ck::consolidate(clean_run + "/checkpoints/last.ckpt", a_path, /*force=*/false);
  ck::consolidate(chaos_run + "/checkpoints/last.ckpt", b_path, /*force=*/false);
  ck::SafetensorsReader a(a_path), b(b_path);
  std::vector<std::string> names_a, names_b;
  for (const auto& e : a.entries()) names_a.push_back(e.name);
  for (const auto& e : b.entries()) names_b.push_back(e.name);
  EXPECT_EQ(names_a, names_b) << "the final checkpoints hold other tensors";
  size_t compared = 0, optimizer = 0;
  for (const auto& e : a.entries()) {
    const ck::TensorEntry* f = b.find(e.name);
    if (!f) continue;
    EXPECT_EQ(e.dtype, f->dtype) << e.name;
    EXPECT_EQ(e.shape, f->shape) << e.name;
    if (e.dtype != f->dtype || e.shape != f->shape) continue;
    const at::Tensor ta = ck::dense_cpu(a.read(e.name)), tb = ck::dense_cpu(b.read(e.name));
    const size_t n = ta.numel() * ta.element_size();
    EXPECT_TRUE(std::memcmp(ta.data_ptr(), tb.data_ptr(), n) == 0)
        << e.name << " differs from the uninterrupted run's (" << n << " bytes)";
    ++compared;
    if (e.name.rfind("optimizer", 0) == 0) ++optimizer;
  }
  EXPECT_GT(compared, 0u);
  EXPECT_GT(optimizer, 0u) << "no optimizer state compared";
  for (const char* key : {"tessera.values", "tessera.keys", "tessera.kinds"}) {
    EXPECT_EQ(replace_all(a.meta(key), clean_run, "<OUT>"), replace_all(b.meta(key), chaos_run, "<OUT>"))
        << "checkpoint metadata " << key << " differs from the uninterrupted run's";
  }
  EXPECT_NE(a.meta("tessera.values").find("global_step"), std::string::npos);
  return compared;
}

std::string text_file_content() {
  std::ostringstream s;
  const char* words[] = {"shard", "tensor", "rank", "gather", "scatter", "reduce", "checkpoint", "module"};
  for (int i = 0; i < 1500; ++i) s << words[(i * 7 + i / 3) % 8] << ((i % 11 == 10) ? ".\n" : " ");
  return s.str();
}

}  // namespace

struct ChaosMode {
  bool async;
  int nodes;
};
void PrintTo(const ChaosMode& m, std::ostream* os) {
  *os << (m.async ? "async" : "sync") << " checkpoints, " << m.nodes << (m.nodes > 1 ? " nodes" : " node");
}

class Chaos : public ::testing::TestWithParam<ChaosMode> {
 protected:
  void SetUp() override {
    if (!fs::exists(kGptBin)) GTEST_SKIP() << kGptBin << " not built (examples disabled)";
    if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " not found";
  }
};

TEST_P(Chaos, KillSegvStopOfRandomRanksFinishBitIdenticalAndLeaveNothing) {
  const bool async = GetParam().async;
  const int nodes = GetParam().nodes;
  const uint64_t seed = base_seed() + (async ? 1 : 0) + (nodes > 1 ? 2 : 0);
  const int failures = scaled(3, 12);
  const int every = 4;  // --ckpt-every
  const int steps = 10 * (failures + 1);
  const std::string dir = temp_dir("tessera-chaos");
  const std::string data = dir + "/text.txt";
  write_bytes(data, text_file_content());
  const std::string report_path = dir + "/report.json";
  std::ostringstream cmd;
  cmd << kNoLauncherEnv << kPython << " " << kDriver << " --build " << TESSERA_BINARY_DIR << " --work " << dir
      << "/work --json " << report_path << " --data " << data << " --seed " << seed << " --steps " << steps
      << " --ckpt-every " << every << " --failures " << failures << " --signals KILL,SEGV,STOP"
      << " --comm-timeout 3 --launcher-arg=--grace=1 --time-limit 100" << (async ? " --async-ckpt" : "")
      << " --nodes " << nodes;
  std::cout << "chaos test: seed " << seed << " (TESSERA_SEED=" << base_seed() << " reruns it)" << std::endl;
  auto [rc, out] = run_command(cmd.str());
  std::cout << out;
  ASSERT_TRUE(fs::exists(report_path)) << "the driver wrote no report (exit " << rc << "): " << out;
  const json r = json::parse(read_bytes(report_path));
  EXPECT_EQ(rc, 0) << "problems: " << r["problems"].dump(1) << "\nseed " << seed;

  // The job ended by itself, after restarting once per failure.
  const json& chaos = r["chaos"];
  EXPECT_EQ(chaos["exit_code"].get<int>(), 0) << "seed " << seed << "; log " << chaos["log"];
  EXPECT_EQ(r["injected"].get<int>(), failures) << "seed " << seed;
  EXPECT_EQ(r["recovered"].get<int>(), failures) << "seed " << seed;
  EXPECT_GE(chaos["restarts"].get<int>(), failures) << "seed " << seed;
  ASSERT_FALSE(chaos["done"].is_null()) << "seed " << seed;
  EXPECT_EQ(chaos["done"]["step"].get<int>(), steps);
  EXPECT_EQ(r["clean"]["exit_code"].get<int>(), 0);
  EXPECT_EQ(r["clean"]["restarts"].get<int>(), 0) << "the uninterrupted run restarted";

  // Every signal was used, each failure lost at most the bound, and nothing of an earlier
  // round was alive at the first step after its restart.
  const int bound = (async ? 2 : 1) * every;
  EXPECT_EQ(r["lost_bound_steps"].get<int>(), bound);
  std::set<std::string> signals;
  std::cout << "failure  signal rank  reached resumed lost  report_s restart_s resume_s first_step_s\n";
  for (const json& f : chaos["failures"]) {
    signals.insert(f["signal"].get<std::string>());
    ASSERT_TRUE(f.contains("first_step_s")) << f.dump();
    const int reached = f["step_reached"], resumed = f["resumed_from"], lost = f["lost_steps"];
    std::cout << "  " << f["index"].get<int>() + 1 << "      SIG" << f["signal"].get<std::string>() << "   "
              << f["rank"] << "    " << reached << "     " << resumed << "      " << lost << "     "
              << f.value("failure_report_s", -1.0) << "  " << f.value("restart_s", -1.0) << "  "
              << f.value("resume_s", -1.0) << "  " << f["first_step_s"] << "\n";
    EXPECT_EQ(lost, reached - resumed);
    EXPECT_GE(lost, 0) << f.dump();
    EXPECT_LE(lost, bound) << "seed " << seed << ": " << f.dump();
    EXPECT_EQ(resumed % every, 0) << "resumed from a step that is no checkpoint step: " << f.dump();
    EXPECT_TRUE(f["orphans_after_restart"].empty()) << f.dump();
    EXPECT_TRUE(f["dead_ranks_shm_after_restart"].empty()) << f.dump();
  }
  std::cout << std::flush;
  if (failures >= 3) EXPECT_EQ(signals, (std::set<std::string>{"KILL", "SEGV", "STOP"}));

  // Bit-identical final state: the driver's comparison of every shard's tensors, and the
  // library's, here.
  EXPECT_TRUE(r["bit_identical"].get<bool>()) << r["differences"].dump(1) << "\nseed " << seed;
  EXPECT_GT(r["compared_tensors"].get<int>(), 0);
  const std::string work = dir + "/work";
  const size_t compared = expect_same_final_state(work + "/clean", work + "/chaos", dir);
  std::cout << "chaos test: " << compared << " tensors of the consolidated final checkpoints bit-identical" << std::endl;

  // Nothing left behind at the end, by either run.
  for (const char* run : {"clean", "chaos"}) {
    const json& left = r[run]["leftovers"];
    EXPECT_TRUE(left["processes"].empty()) << run << ": " << left.dump();
    EXPECT_TRUE(left["shm_segments"].empty()) << run << ": " << left.dump();
    EXPECT_TRUE(left["temporaries"].empty()) << run << ": " << left.dump();
    EXPECT_EQ(left["run_lock"].get<std::string>(), "free") << run << ": " << left.dump();
  }
  std::cout << "chaos test: " << r["summary"].dump() << std::endl;
}

INSTANTIATE_TEST_SUITE_P(SyncAndAsyncCheckpoints, Chaos,
                         ::testing::Values(ChaosMode{false, 1}, ChaosMode{true, 1}, ChaosMode{false, 2}),
                         [](const ::testing::TestParamInfo<ChaosMode>& i) {
                           return std::string(i.param.async ? "Async" : "Sync") + (i.param.nodes > 1 ? "TwoNodes" : "");
                         });
