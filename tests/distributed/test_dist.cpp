// Collectives, subgroups and failure detection with real rank processes.
#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "support/build_paths.h"
#include "support/harness.h"
#include "tessera/distributed/communicator.h"
#include "tessera/distributed/rendezvous.h"  // find_free_port

using namespace tessera;
using tessera::testing::run_ranks;
using tessera::testing::RanksResult;

class Collectives : public ::testing::TestWithParam<int> {};

namespace {
// Runs the collectives scenario on `n` ranks and checks which transport carried it.
void expect_collectives(int n, const std::string& transport, std::map<std::string, std::string> env = {}) {
  auto res = run_ranks(n, {"collectives"}, 120, std::move(env));
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < n; ++r) {
    ASSERT_GE(res.out[r].size(), 2u) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "collectives ok rank " + std::to_string(r) + " of " + std::to_string(n));
    EXPECT_EQ(res.out[r][res.out[r].size() - 2], "transport " + transport) << res.all_output();
  }
}
}  // namespace

// Ranks on one host: the shared-memory channel (default 1 MiB chunks).
TEST_P(Collectives, EveryOpEveryDtypeUnevenAndEmptyPieces) {
  expect_collectives(GetParam(), GetParam() == 1 ? "gloo" : "shm");
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4));

// 4 KiB chunks: every large collective takes many rounds, so slot reuse and the
// per-rank regions of reduce-scatter are exercised.
class CollectivesSmallChunks : public ::testing::TestWithParam<int> {};
TEST_P(CollectivesSmallChunks, ManyRoundsPerCollective) {
  expect_collectives(GetParam(), "shm", {{"TESSERA_TEST_SHM_CHUNK", "4096"}});
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesSmallChunks, ::testing::Values(2, 3, 4));

// TESSERA_SHM=0: the same semantics over Gloo (point to point for all-gather and
// reduce-scatter), as between hosts.
class CollectivesOverGloo : public ::testing::TestWithParam<int> {};
TEST_P(CollectivesOverGloo, EveryOpEveryDtypeUnevenAndEmptyPieces) {
  expect_collectives(GetParam(), "gloo", {{"TESSERA_SHM", "0"}});
}
INSTANTIATE_TEST_SUITE_P(WorldSizes, CollectivesOverGloo, ::testing::Values(2, 3));

// CommOptions::gloo_native through TESSERA_GLOO_NATIVE: off, even pieces still go point to
// point (the native forms are never tried); on, they are tried, and run where this Gloo has
// them (torch 2.x) or fall back (1.13), with the same results either way.
TEST(CollectivesOverGloo, NativeSingleTensorFormsAreOptInAndAgree) {
  for (const char* native : {"0", "1"}) {
    auto res = run_ranks(3, {"collectives"}, 120, {{"TESSERA_SHM", "0"}, {"TESSERA_GLOO_NATIVE", native}});
    EXPECT_RANKS_OK(res);
    for (int r = 0; r < 3; ++r) {
      ASSERT_GE(res.out[r].size(), 3u) << res.all_output();
      EXPECT_EQ(res.out[r].back(), "collectives ok rank " + std::to_string(r) + " of 3");
      const std::string routes = res.out[r][res.out[r].size() - 3];
      if (native[0] == '0') {
        EXPECT_EQ(routes, "gloo single-tensor all_gather -1 reduce_scatter -1") << res.all_output();
      } else {
        EXPECT_TRUE(routes == "gloo single-tensor all_gather 1 reduce_scatter 1" ||
                    routes == "gloo single-tensor all_gather 0 reduce_scatter 0")
            << routes << "\n" << res.all_output();
      }
    }
  }
}

// distributed::shared_memory_times: the time a rank spent in collectives and, of it,
// the time it waited for a late peer (what gpt reports for its timed steps).
TEST(SharedMemory, TimesCountTheWaitForALatePeer) {
  auto res = run_ranks(2, {"shm_times"});
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "shm times ok rank " + std::to_string(r)) << res.all_output();
  }
}

// Ranks that enter different collectives get an error naming both (Gloo would hang or
// deliver garbage), and the channel refuses further use. The segment's name is gone
// from /dev/shm once the ranks have mapped it.
TEST(SharedMemory, MismatchedCollectivesAreAnErrorNamingBoth) {
  auto res = run_ranks(3, {"collective_mismatch"});
  EXPECT_RANKS_OK(res);
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(res.out[r].empty()) << res.all_output();
    EXPECT_EQ(res.out[r].back(), "mismatch detected rank " + std::to_string(r)) << res.all_output();
  }
  ASSERT_FALSE(res.launch.ranks.empty());
  const std::string prefix = "tessera-" + std::to_string(res.launch.ranks[0].pid) + "-";
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(e.path().filename().string().rfind(prefix, 0), 0u) << "left behind: " << e.path();
  }
}

TEST(Collectives, SingleProcessNeedsNoRendezvous) {
  auto c = distributed::Communicator::create(distributed::World{});
  at::Tensor t = at::ones({3});
  c->all_reduce(t, distributed::ReduceOp::Avg);
  EXPECT_TRUE(at::equal(t, at::ones({3})));
  EXPECT_TRUE(at::equal(c->all_gather(at::arange(4)), at::arange(4)));
  EXPECT_TRUE(at::equal(c->reduce_scatter(at::arange(4), {4}), at::arange(4)));
  EXPECT_EQ(c->all_gather_bytes("abc"), std::vector<std::string>{"abc"});
  c->barrier();
  // counts(): one per call and kind, also in a group of one (where barrier() is a no-op).
  const auto k = c->counts();
  EXPECT_EQ(k.all_reduce, 1);
  EXPECT_EQ(k.all_gather, 1);
  EXPECT_EQ(k.reduce_scatter, 1);
  EXPECT_EQ(k.broadcast, 0);
  at::Tensor b = at::ones({2});
  c->broadcast(b);
  c->all_to_all(at::ones({2}), {2}, {2});
  EXPECT_EQ(c->counts().broadcast, 1);
  EXPECT_EQ(c->counts().all_to_all, 1);
}

TEST(Collectives, BadArgumentsAreClearErrors) {
  auto c = distributed::Communicator::create(distributed::World{});
  try {
    c->all_gather(at::ones({3}), {2});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 holds 3 rows but dim0_sizes says 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(c->reduce_scatter(at::ones({3}), {2}), Error);
  EXPECT_THROW(c->all_gather(at::scalar_tensor(1.0)), Error);
  // An output tensor of the wrong shape, dtype or layout is refused by name.
  for (at::Tensor bad : {at::empty({5}), at::empty({4}, at::kDouble), at::empty({4, 2}).select(1, 0)}) {
    try {
      c->all_gather_async(at::ones({4}), {4}, bad).wait();
      ADD_FAILURE() << "accepted " << bad.sizes() << " " << bad.scalar_type();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("output tensor"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(distributed::Communicator::create(distributed::World{}, distributed::CommOptions{std::chrono::seconds(1), "mpi"}), Error);
}

TEST(Subgroups, HybridLayoutFourRanksAsTwoNodes) {
  auto res = run_ranks(4, {"subgroups", "2"});
  EXPECT_RANKS_OK(res);
}

TEST(Subgroups, ThreeRanksOneNode) {
  auto res = run_ranks(3, {"subgroups", "3"});
  EXPECT_RANKS_OK(res);
}

// A peer dies (SIGKILL) right before a collective: the survivors raise CommError
// themselves (they ignore the launcher's SIGTERM) well within the timeout.
// Over the shared-memory channel (the default between ranks of one host) and over Gloo
// (TESSERA_SHM=0, the path between hosts).
class DeadPeer : public ::testing::TestWithParam<std::string> {
 protected:
  std::map<std::string, std::string> env(const std::string& timeout_ms) const {
    return {{"TESSERA_TEST_TIMEOUT_MS", timeout_ms}, {"TESSERA_SHM", GetParam() == "shm" ? "1" : "0"}};
  }
  void expect_transport(const RanksResult& res) const {
    for (auto& [rank, lines] : res.out)
      EXPECT_NE(std::find(lines.begin(), lines.end(), "transport " + GetParam()), lines.end())
          << "rank " << rank << "\n" << res.all_output();
  }
};

TEST_P(DeadPeer, SurvivorsRaiseInsteadOfHanging) {
  auto res = run_ranks(3, {"dead_peer", "1"}, 60, env("5000"), 30000);
  expect_transport(res);
  EXPECT_EQ(res.launch.failed_rank, 1) << res.all_output();
  EXPECT_EQ(res.launch.exit_code, 128 + 9);
  for (auto& st : res.launch.ranks) {
    if (st.rank == 1) {
      EXPECT_EQ(st.signal, 9);
    } else {
      EXPECT_EQ(st.signal, 0) << "rank " << st.rank << " was killed instead of raising\n" << res.all_output();
      EXPECT_EQ(st.exit_code, 3) << res.all_output();
    }
  }
  EXPECT_LT(res.launch.elapsed.count(), 25000);
  EXPECT_NE(res.all_output().find("all_reduce"), std::string::npos) << res.all_output();
}

// A peer that hangs (alive, silent): the others time out with an error naming the collective.
TEST_P(DeadPeer, HungPeerTimesOut) {
  auto res = run_ranks(2, {"dead_peer", "1", "hang"}, 60, env("3000"), 1000);
  expect_transport(res);
  EXPECT_EQ(res.launch.failed_rank, 0) << res.all_output();
  EXPECT_EQ(res.launch.exit_code, 3) << res.all_output();
  const std::string out = res.all_output();
  EXPECT_NE(out.find("raised after"), std::string::npos) << out;
  // The collective is named with its number, dtype and shape, and the rank that had not arrived.
  EXPECT_NE(out.find("all_reduce #"), std::string::npos) << out;
  EXPECT_NE(out.find("(Float [1024]"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1 had not arrived"), std::string::npos) << out;
  EXPECT_NE(out.find("timed out"), std::string::npos) << out;
  EXPECT_LT(res.launch.elapsed.count(), 20000);
}

INSTANTIATE_TEST_SUITE_P(Transports, DeadPeer, ::testing::Values("shm", "gloo"),
                         [](const auto& info) { return info.param; });

TEST(Rendezvous, MissingPeerTimesOutWithClearError) {
  // World of 2 but only rank 0 starts: store creation/process group must time out.
  distributed::World w;
  w.world_size = 2;
  w.rank = 0;
  w.local_world_size = 2;
  w.master_port = distributed::find_free_port();
  distributed::CommOptions o;
  o.timeout = std::chrono::milliseconds(1500);
  try {
    distributed::Communicator::create(w, o);
    FAIL() << "expected a rendezvous error";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

#include <spawn.h>
#include <sys/wait.h>

extern char** environ;

namespace {
// Starts `n` worker processes with environments made by `env_of(rank)` only (no
// launcher, no torchrun variables), as srun or mpirun would, and returns their exit codes.
std::vector<int> spawn_plain(int n, const std::vector<std::string>& args,
                             const std::function<std::vector<std::string>(int)>& env_of) {
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> envs;
    for (char** e = environ; *e; ++e) {
      std::string kv(*e);
      if (kv.rfind("RANK=", 0) == 0 || kv.rfind("WORLD_SIZE=", 0) == 0 || kv.rfind("SLURM_", 0) == 0 ||
          kv.rfind("OMPI_", 0) == 0 || kv.rfind("LOCAL_", 0) == 0)
        continue;
      envs.push_back(kv);
    }
    for (auto& kv : env_of(r)) envs.push_back(kv);
    std::vector<char*> envp, argv;
    for (auto& s : envs) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string prog = TESSERA_WORKER;
    argv.push_back(prog.data());
    std::vector<std::string> a = args;
    for (auto& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    pid_t pid;
    EXPECT_EQ(posix_spawn(&pid, prog.c_str(), nullptr, nullptr, argv.data(), envp.data()), 0);
    pids.push_back(pid);
  }
  std::vector<int> codes;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    codes.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
  }
  return codes;
}
}  // namespace

TEST(Environments, SrunStyleVariablesAloneAreEnough) {
  const std::string port = std::to_string(distributed::find_free_port());
  auto codes = spawn_plain(2, {"collectives"}, [&](int r) {
    return std::vector<std::string>{"SLURM_PROCID=" + std::to_string(r), "SLURM_NTASKS=2", "SLURM_LOCALID=" + std::to_string(r),
                                    "SLURM_NTASKS_PER_NODE=2", "SLURM_NODELIST=127.0.0.1", "MASTER_PORT=" + port,
                                    "OMP_NUM_THREADS=1"};
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
}

TEST(Environments, MpirunStyleVariablesAloneAreEnough) {
  const std::string port = std::to_string(distributed::find_free_port());
  auto codes = spawn_plain(3, {"collectives"}, [&](int r) {
    return std::vector<std::string>{"OMPI_COMM_WORLD_RANK=" + std::to_string(r), "OMPI_COMM_WORLD_SIZE=3",
                                    "OMPI_COMM_WORLD_LOCAL_RANK=" + std::to_string(r), "OMPI_COMM_WORLD_LOCAL_SIZE=3",
                                    "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port, "OMP_NUM_THREADS=1"};
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
}

TEST(Collectives, AllToAllUnevenAndEmpty) {
  for (int n : {1, 2, 3}) {
    auto res = run_ranks(n, {"all_to_all"});
    EXPECT_RANKS_OK(res);
  }
}
