// Checkpoints across real rank processes: N -> M resharding for N, M in 1..4, full
// (consolidated) saves loaded sharded, plain <-> sharded layouts, async saves, and
// kill -9 during saves.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <set>
#include <thread>

#include "reliability/reliability_util.h"
#include "support/build_paths.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/storage/file.h"

extern char** environ;

using namespace tessera;
using tessera::testing::run_ranks;
using tessera::testing::temp_dir;
namespace ck = tessera::checkpoint;

namespace {

}  // namespace

// Save at N ranks (sharded), load at every M in 1..4: bit-exact, uneven shapes, bf16/f32,
// zero-size tensors, values. The checkpoint of N is also loaded into a plain layout.
class CheckpointReshard : public ::testing::TestWithParam<int> {};

TEST_P(CheckpointReshard, SaveAtNLoadAtEveryM) {
  const int n = GetParam();
  const std::string dir = temp_dir() + "/ckpt";
  auto s = run_ranks(n, {"ckpt_save", dir, "sharded", "sharded"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  ck::VerifyReport v = ck::verify(dir);
  EXPECT_TRUE(v.ok);
  EXPECT_NE(ck::inspect(dir).find("world size at save " + std::to_string(n)), std::string::npos);
  for (int m = 1; m <= 4; ++m) {
    auto l = run_ranks(m, {"ckpt_load", dir, "sharded"}, 120);
    EXPECT_EQ(l.launch.exit_code, 0) << "save " << n << " -> load " << m << "\n" << l.all_output();
    for (int r = 0; r < m; ++r) {
      ASSERT_FALSE(l.out[r].empty()) << l.all_output();
      EXPECT_EQ(l.out[r].back().rfind("loaded ok rank " + std::to_string(r), 0), 0u);
    }
  }
  auto p = run_ranks(1, {"ckpt_load", dir, "plain"}, 120);
  EXPECT_EQ(p.launch.exit_code, 0) << p.all_output();
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, CheckpointReshard, ::testing::Values(1, 2, 3, 4));

// A consolidated save from 3 ranks: every rank writes its rows of the dim-0 sharded
// tensors into the one file (rank 0 gathers the dim-1 sharded ones), or, with
// TESSERA_FULL_SAVE_ONE_WRITER (what ranks that cannot open rank 0's file fall back
// to), rank 0 writes everything. Both verify and load at 1, 2 and 4 ranks.
TEST(CheckpointDist, FullSaveFromShardsLoadsShardedAndPlain) {
  for (bool one_writer : {false, true}) {
    const std::string file = temp_dir() + "/full.safetensors";
    std::map<std::string, std::string> env = {{"TESSERA_LOG_LEVEL", "debug"}};
    if (one_writer) env["TESSERA_FULL_SAVE_ONE_WRITER"] = "1";
    auto s = run_ranks(3, {"ckpt_save", file, "full", "sharded"}, 120, env);
    ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
    const std::string mode = one_writer ? "(rank 0 writes)" : "(every rank writes)";
    EXPECT_NE(s.all_output().find(mode), std::string::npos) << mode << "\n" << s.all_output();
    EXPECT_TRUE(ck::verify(file).ok);
    for (int m : {1, 2, 4}) {
      auto l = run_ranks(m, {"ckpt_load", file, "sharded"}, 120);
      EXPECT_EQ(l.launch.exit_code, 0) << "full -> " << m << "\n" << l.all_output();
    }
  }
}

// Tensors of 40 MiB, each rank's rows written in several slices (by every rank at
// once, or gathered to rank 0 and written while the next slice is gathered); the file
// must equal the tensors exactly.
TEST(CheckpointDist, FullSaveStreamsLargeTensorsInSlices) {
  for (bool one_writer : {false, true}) {
    const std::string file = temp_dir() + "/big.safetensors";
    std::map<std::string, std::string> env;
    if (one_writer) env["TESSERA_FULL_SAVE_ONE_WRITER"] = "1";
    auto s = run_ranks(3, {"ckpt_full_big", file}, 180, env);
    ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
    EXPECT_TRUE(ck::verify(file).ok);
  }
}

TEST(CheckpointDist, PlainSaveLoadsSharded) {
  const std::string dir = temp_dir() + "/plain";
  auto s = run_ranks(2, {"ckpt_save", dir, "sharded", "plain"}, 120);
  ASSERT_EQ(s.launch.exit_code, 0) << s.all_output();
  auto l = run_ranks(3, {"ckpt_load", dir, "sharded"}, 120);
  EXPECT_EQ(l.launch.exit_code, 0) << l.all_output();
}

// prepare_async_save creates the background communicator once; save_async returns
// before the write begins (the worker holds each rank's background
// write at a test gate and checks that the save is not done and nothing is on disk), the
// snapshot ignores later changes, the caller's collectives run on, and a second save
// waits for the first.
TEST(CheckpointDist, AsyncSavesOverlapCollectivesAndSecondWaitsForFirst) {
  const std::string dir = temp_dir() + "/async";
  auto r = run_ranks(2, {"ckpt_async", dir}, 120);
  EXPECT_EQ(r.launch.exit_code, 0) << r.all_output();
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_FALSE(r.out[rank].empty()) << r.all_output();
    EXPECT_EQ(r.out[rank].back(), "async ok rank " + std::to_string(rank)) << r.all_output();
  }
  EXPECT_TRUE(ck::verify(dir).ok);
  EXPECT_TRUE(ck::verify(dir + ".2").ok);
}

// A consolidated background save cannot gather a tensor sharded over a subgroup (a
// data-parallel group of a (dp 2, tp 2) mesh here): every rank refuses it naming the key,
// before anything is written.
TEST(CheckpointDist, AsyncFullSaveOfASubgroupTensorNamesTheKey) {
  const std::string dir = temp_dir() + "/full.safetensors";
  auto r = run_ranks(4, {"ckpt_async_full_2d", dir}, 120);
  EXPECT_EQ(r.launch.exit_code, 0) << r.all_output();
  for (int rank = 0; rank < 4; ++rank) {
    ASSERT_FALSE(r.out[rank].empty()) << r.all_output();
    EXPECT_CONTAINS(r.out[rank].back(), "key 'tp.norm' is sharded over a group of 2 of the 4 ranks");
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

// A byte of rank 1's data file is flipped (size unchanged): only rank 1 reads that file
// at the same world size, so only rank 1 meets the checksum error; rank 0 must fail too,
// naming rank 1 and its error. Each rank's own output is checked.
TEST(CheckpointDist, LoadErrorOnOneRankIsRaisedOnAll) {
  const std::string dir = temp_dir() + "/c";
  ASSERT_EQ(run_ranks(2, {"ckpt_save", dir, "sharded", "sharded"}, 120).launch.exit_code, 0);
  const std::string file = dir + "/data-rank00001.safetensors";
  std::string bytes = tessera::testing::read_bytes(file);
  ASSERT_GT(bytes.size(), 8u);
  bytes.back() = static_cast<char>(bytes.back() ^ 0x5a);  // the last byte is tensor data
  tessera::testing::write_bytes(file, bytes);
  auto l = run_ranks(2, {"ckpt_load_error", dir}, 120);
  ASSERT_EQ(l.launch.exit_code, 0) << l.all_output();
  const std::string bad = "data-rank00001.safetensors' key '";
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(l.out[rank].size(), 1u) << "rank " << rank << "\n" << l.all_output();
    const std::string& line = l.out[rank][0];
    EXPECT_EQ(line.rfind("load error rank " + std::to_string(rank) + ": ", 0), 0u) << line;
    EXPECT_NE(line.find(bad), std::string::npos) << line;
    EXPECT_NE(line.find("checksum mismatch"), std::string::npos) << line;
  }
  // Rank 0 read nothing bad itself: its error is rank 1's, passed on.
  EXPECT_NE(l.out[0][0].find("failed on rank 1: "), std::string::npos) << l.out[0][0];
  EXPECT_EQ(l.out[1][0].find("failed on rank"), std::string::npos) << l.out[1][0];
}

// kill -9 at random points of a save loop: the checkpoint at the path always loads and
// is one whole iteration, never a torn mix. 8 kills (two of them of consolidated saves);
// 40 with TESSERA_SOAK=1 (make soak, make bench).
TEST(CheckpointCrash, KillDuringSaveLeavesALoadablePreviousCheckpoint) {
  const std::string dir = temp_dir();
  const std::string path = dir + "/ckpt";
  std::mt19937 rng(12345);
  std::set<int64_t> seen;
  int kills_mid_loop = 0;
  const int rounds = tessera::testing::scaled(8, 40);
  for (int round = 0; round < rounds; ++round) {
    const char* mode = round % 4 == 3 ? "full" : "sharded";
    const std::string target = round % 4 == 3 ? dir + "/full.safetensors" : path;
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addclose(&fa, out[0]);
    std::vector<std::string> argv_s = {TESSERA_WORKER, "ckpt_save_loop", target, mode};
    std::vector<char*> argv;
    for (auto& a : argv_s) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    ASSERT_EQ(::posix_spawn(&pid, TESSERA_WORKER, &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    ::close(out[1]);
    // Wait (bounded) until the first save of this round committed, then kill at a random delay.
    std::string buf;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (buf.find("saved 1\n") == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      pollfd p{out[0], POLLIN, 0};
      if (::poll(&p, 1, 200) > 0) {
        char b[256];
        ssize_t k = ::read(out[0], b, sizeof b);
        if (k <= 0) break;
        buf.append(b, static_cast<size_t>(k));
      }
    }
    ASSERT_NE(buf.find("saved 1\n"), std::string::npos) << "worker did not save: " << buf;
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 30000)(rng)));
    ::kill(pid, SIGKILL);
    int st = 0;
    ::waitpid(pid, &st, 0);
    ::close(out[0]);
    if (WIFSIGNALED(st)) ++kills_mid_loop;
    auto v = run_ranks(1, {"ckpt_verify_iter", target}, 60);
    ASSERT_EQ(v.launch.exit_code, 0) << "round " << round << ": the checkpoint does not load\n" << v.all_output();
    ASSERT_FALSE(v.out[0].empty());
    seen.insert(std::stoll(v.out[0].back().substr(10)));
    EXPECT_TRUE(ck::verify(target).ok) << "round " << round;
  }
  EXPECT_EQ(kills_mid_loop, rounds);
  EXPECT_GT(seen.size(), 1u);  // kills landed at different iterations
}
