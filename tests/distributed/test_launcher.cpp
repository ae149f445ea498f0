// The launcher and `tessera run`: exit codes, signals, orphans, output prefixing.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <regex>
#include <thread>

#include "support/build_paths.h"
#include "support/test_util.h"
#include "reliability/reliability_util.h"
#include "support/harness.h"

using tessera::testing::run_ranks;

using tessera::testing::run_command;

namespace {

bool alive(int pid) {
  if (::kill(pid, 0) != 0) return false;
  // A zombie still answers kill(0); look at its state.
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  std::getline(f, s);
  auto p = s.rfind(')');
  return p != std::string::npos && p + 2 < s.size() && s[p + 2] != 'Z';
}

bool gone_within(int pid, int ms) {
  for (int i = 0; i < ms / 20; ++i) {
    if (!alive(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return !alive(pid);
}

std::vector<int> pids_in(const std::string& text, const std::string& word) {
  std::vector<int> pids;
  std::regex re(word + " ([0-9]+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator(); ++it)
    pids.push_back(std::stoi((*it)[1]));
  return pids;
}

// Runs a shell command, returns (exit status, stdout).

}  // namespace

TEST(Launcher, ExitCodeOfTheFailingRankIsPropagated) {
  auto res = run_ranks(3, {"exit_code", "2", "7"}, 60);
  EXPECT_EQ(res.launch.exit_code, 7);
  EXPECT_EQ(res.launch.failed_rank, 2);
  EXPECT_NE(res.launch.message.find("rank 2"), std::string::npos) << res.launch.message;
  for (auto& st : res.launch.ranks) {
    if (st.rank != 2) {
      EXPECT_TRUE(st.stopped_by_launcher);
      EXPECT_EQ(st.signal, SIGTERM);
    }
  }
  EXPECT_LT(res.launch.elapsed.count(), 15000);
}

TEST(Launcher, SigkilledRankStopsTheOthersAndLeavesNoOrphans) {
  auto res = run_ranks(4, {"exit_code", "1", "-9", "300", "spawn"}, 60);
  EXPECT_EQ(res.launch.exit_code, 128 + 9);
  EXPECT_EQ(res.launch.failed_rank, 1);
  EXPECT_NE(res.launch.message.find("signal 9"), std::string::npos) << res.launch.message;
  EXPECT_LT(res.launch.elapsed.count(), 15000);
  for (auto& st : res.launch.ranks) EXPECT_FALSE(alive(st.pid)) << "rank " << st.rank;
  auto grandchildren = pids_in(res.all_output(), "grandchild");
  EXPECT_EQ(grandchildren.size(), 3u) << res.all_output();
  for (int pid : grandchildren) EXPECT_TRUE(gone_within(pid, 2000)) << "grandchild " << pid << " survived";
}

// Ranks frozen by SIGSTOP when another fails: the launcher's TERM is followed by a CONT, so
// they end at once instead of at the KILL a grace period (30 s here) later.
TEST(Launcher, StoppedRanksEndAtTheTermNotAfterTheGrace) {
  auto res = run_ranks(3, {"exit_code", "2", "7", "1500", "stop"}, 120, {}, /*grace_ms=*/30000);
  EXPECT_EQ(res.launch.exit_code, 7) << res.all_output();
  EXPECT_EQ(res.launch.failed_rank, 2);
  for (int r : {0, 1}) EXPECT_NE(res.all_output().find("stopping rank " + std::to_string(r)), std::string::npos);
  for (auto& st : res.launch.ranks) {
    if (st.rank == 2) continue;
    EXPECT_TRUE(st.stopped_by_launcher) << "rank " << st.rank;
    EXPECT_EQ(st.signal, SIGTERM) << "rank " << st.rank << " was not ended by the TERM";
  }
  EXPECT_LT(res.launch.elapsed.count(), 20000) << "the stopped ranks waited for the KILL";
}

TEST(Launcher, AllSucceedMeansExitZero) {
  auto res = run_ranks(2, {"echo"}, 60);
  EXPECT_EQ(res.launch.exit_code, 0) << res.launch.message;
  EXPECT_EQ(res.launch.failed_rank, -1);
  // Torchrun environment and one intra-op thread per rank.
  ASSERT_EQ(res.out[1].size(), 3u);
  EXPECT_EQ(res.out[1][2], "omp=1 world=2 local=1 group=0 tail-without-newline");
  EXPECT_EQ(res.err[0].at(0), "err line from 0");
}

TEST(Launcher, DeadlineStopsEverything) {
  auto res = run_ranks(2, {"exit_code", "5", "0"}, 1);  // no rank 5: everyone waits
  EXPECT_EQ(res.launch.exit_code, 124);
  for (auto& st : res.launch.ranks) EXPECT_FALSE(alive(st.pid));
}

TEST(Launcher, BadOptionsAreRefused) {
  tessera::distributed::LaunchOptions o;
  o.command = {"true"};
  o.nnodes = 2;
  EXPECT_THROW(tessera::distributed::launch(o), tessera::Error);  // port required with 2 nodes
  o.nnodes = 1;
  o.node_rank = 1;
  EXPECT_THROW(tessera::distributed::launch(o), tessera::Error);
}

TEST(Launcher, MissingProgramFailsWithCode127) {
  tessera::distributed::LaunchOptions o;
  o.command = {"/nonexistent/program"};
  o.nproc_per_node = 2;
  o.forward_signals = false;
  o.on_line = [](int, bool, const std::string&) {};
  auto r = tessera::distributed::launch(o);
  EXPECT_EQ(r.exit_code, 127);
}

// --max-restarts: a failed round is stopped and every rank started again, with the
// restart count in the environment; the ranks of each round meet through the
// launcher's store under that round's keys (the first round's keys are still there).
TEST(Launcher, MaxRestartsStartsEveryRankAgainUntilTheJobSucceeds) {
  auto res = run_ranks(3, {"restart_then_reduce", "1", "2"}, 120, {}, 3000, /*max_restarts=*/3);
  EXPECT_EQ(res.launch.exit_code, 0) << res.launch.message << "\n" << res.all_output();
  EXPECT_EQ(res.launch.restarts, 2);
  ASSERT_EQ(res.launch.failures.size(), 2u);
  for (const auto& f : res.launch.failures) EXPECT_NE(f.find("rank 1 "), std::string::npos) << f;
  for (int r = 0; r < 3; ++r) {
    std::string seen;
    for (const auto& l : res.out[r])
      if (l.rfind("restart count", 0) == 0) seen += l.substr(0, l.find(" rank")) + ";";
    EXPECT_EQ(seen, "restart count 0;restart count 1;restart count 2;") << res.all_output();
  }
  for (auto& st : res.launch.ranks) {
    EXPECT_EQ(st.exit_code, 0) << "rank " << st.rank;
    EXPECT_FALSE(alive(st.pid));
  }
}

TEST(Launcher, MaxRestartsSpentEndsWithTheLastFailure) {
  auto res = run_ranks(2, {"restart_then_reduce", "0", "100"}, 120, {}, 3000, /*max_restarts=*/2);
  EXPECT_EQ(res.launch.exit_code, 5) << res.launch.message;
  EXPECT_EQ(res.launch.failed_rank, 0);
  EXPECT_EQ(res.launch.restarts, 2);
  EXPECT_EQ(res.launch.failures.size(), 2u);
}

// A program that cannot be executed fails the same way in every round: no restart.
TEST(Launcher, MissingProgramIsNotRestarted) {
  tessera::distributed::LaunchOptions o;
  o.command = {"/nonexistent/program"};
  o.nproc_per_node = 2;
  o.max_restarts = 5;
  o.forward_signals = false;
  o.on_line = [](int, bool, const std::string&) {};
  auto r = tessera::distributed::launch(o);
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.restarts, 0);
}

TEST(TesseraRun, PrefixesOutputAndPropagatesExitCode) {
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 2 -- " + TESSERA_WORKER + " echo 2>&1");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("[rank 0] out line 1 from 0"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] out line 2 from 1"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] err line from 1"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] omp=1 world=2 local=0 group=0 tail-without-newline"), std::string::npos) << out;

  auto [code2, out2] = run_command(std::string(TESSERA_CLI) + " run -n 2 " + TESSERA_WORKER + " exit_code 1 4 2>&1");
  EXPECT_EQ(code2, 4) << out2;
  EXPECT_NE(out2.find("tessera run: rank 1"), std::string::npos) << out2;

  auto [code3, out3] = run_command(std::string(TESSERA_CLI) + " run -n 0 -- true 2>&1");
  EXPECT_NE(code3, 0);
  EXPECT_NE(out3.find("nproc-per-node"), std::string::npos) << out3;
}

TEST(TesseraRun, MultiNodeFlagsComputeGlobalRanks) {
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 2 --nnodes 3 --node-rank 2 --master-addr 10.0.0.1 --master-port 1 " +
                        "--threads-per-rank 3 -- sh -c 'echo r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK g=$GROUP_RANK " +
                        "t=$OMP_NUM_THREADS' 2>&1");
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("r=4 w=6 l=0 g=2 t=3"), std::string::npos) << out;
  EXPECT_NE(out.find("r=5 w=6 l=1 g=2 t=3"), std::string::npos) << out;
}

// SIGTERM to `tessera run` is forwarded; SIGKILL of `tessera run` itself takes the
// ranks down with it (parent-death signal) and what they started (the guard process
// kills their process groups): no orphans either way. Each rank leaves a grandchild
// (`sleep 60`) in its process group.
TEST(TesseraRun, LauncherDeathLeavesNoOrphans) {
  for (int sig : {SIGTERM, SIGKILL}) {
    int pipefd[2];
    ASSERT_EQ(::pipe(pipefd), 0);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(pipefd[1], 1);
      ::dup2(pipefd[1], 2);
      ::close(pipefd[0]);
      ::execl(TESSERA_CLI, TESSERA_CLI, "run", "-n", "2", "--", TESSERA_WORKER, "exit_code", "9", "0", "0", "spawn",
              nullptr);
      ::_exit(127);
    }
    ::close(pipefd[1]);
    std::string out;
    char buf[512];
    std::vector<int> ranks, grandchildren;
    auto t0 = std::chrono::steady_clock::now();
    while ((ranks.size() < 2 || grandchildren.size() < 2) &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
      ssize_t n = ::read(pipefd[0], buf, sizeof(buf));
      if (n <= 0) break;
      out.append(buf, n);
      ranks = pids_in(out, "pid");
      grandchildren = pids_in(out, "grandchild");
    }
    ASSERT_EQ(ranks.size(), 2u) << out;
    ASSERT_EQ(grandchildren.size(), 2u) << out;
    ::kill(pid, sig);
    int st = 0;
    ::waitpid(pid, &st, 0);
    if (sig == SIGTERM) {
      EXPECT_TRUE(WIFEXITED(st));
      EXPECT_EQ(WEXITSTATUS(st), 128 + SIGTERM);
    }
    for (int r : ranks) EXPECT_TRUE(gone_within(r, 5000)) << "rank pid " << r << " outlived the launcher (sig " << sig << ")";
    for (int g : grandchildren)
      EXPECT_TRUE(gone_within(g, 5000)) << "pid " << g << ", started by a rank, outlived the launcher (sig " << sig
                                        << ")\n" << out;
    for (int g : grandchildren) ::kill(g, SIGKILL);  // whatever happened, leave nothing behind
    // After the launcher, nothing holds its output open for long: end of file arrives.
    while (::read(pipefd[0], buf, sizeof(buf)) > 0) {
    }
    ::close(pipefd[0]);
  }
}

// A program that cannot be executed is named with the reason, once, and no rank is left.
TEST(TesseraRun, ProgramThatCannotBeExecutedIsNamedWithTheReason) {
  const std::string dir = tessera::testing::temp_dir("tessera-run-exec");
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 3 -- " + dir + "/no-such-program --flag");
  EXPECT_EQ(code, 127) << out;
  const std::string want = "tessera run: cannot execute the program '" + dir + "/no-such-program' for rank 0: " +
                           "No such file or directory (errno 2)";
  EXPECT_NE(out.find(want), std::string::npos) << out;
  EXPECT_EQ(out.find("cannot execute"), out.rfind("cannot execute")) << "reported more than once:\n" << out;

  tessera::testing::write_bytes(dir + "/not-executable", "#!/bin/sh\necho hi\n");
  auto [code2, out2] = run_command(std::string(TESSERA_CLI) + " run -n 2 -- " + dir + "/not-executable");
  EXPECT_EQ(code2, 127) << out2;
  EXPECT_NE(out2.find("cannot execute the program '" + dir + "/not-executable' for rank 0: Permission denied"),
            std::string::npos)
      << out2;
  EXPECT_EQ(out2.find("hi"), std::string::npos) << out2;
}

// A failing rank is reported by the launcher in one line.
TEST(TesseraRun, FailingRankIsReportedOnce) {
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 3 --grace 1 -- " + TESSERA_WORKER +
                                 " exit_code 1 4 2>&1");
  EXPECT_EQ(code, 4) << out;
  size_t reports = 0;
  for (size_t p = out.find("rank 1 (pid"); p != std::string::npos; p = out.find("rank 1 (pid", p + 1)) ++reports;
  EXPECT_EQ(reports, 1u) << out;
  EXPECT_NE(out.find("tessera run: rank 1 (pid"), std::string::npos) << out;
  EXPECT_NE(out.find("exited with code 4; stopping the other ranks"), std::string::npos) << out;
}

// More than one node needs the address of node 0: refused at once, naming the flag,
// instead of every other node waiting for its own 127.0.0.1 until the timeout.
TEST(TesseraRun, SeveralNodesWithoutMasterAddrIsAUsageError) {
  auto [code, out] = run_command(std::string(TESSERA_CLI) + " run -n 1 --nnodes 2 --node-rank 1 --master-port 29999 " +
                                 "-- sh -c 'echo started'");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("--nnodes 2 needs --master-addr"), std::string::npos) << out;
  EXPECT_EQ(out.find("started"), std::string::npos) << out;
  // Given explicitly, a loopback address is taken as it is (nodes simulated on one machine).
  auto [code2, out2] = run_command(std::string(TESSERA_CLI) + " run -n 1 --nnodes 2 --node-rank 1 " +
                                   "--master-addr 127.0.0.1 --master-port 29999 -- sh -c 'echo started'");
  EXPECT_EQ(code2, 0) << out2;
  EXPECT_NE(out2.find("[rank 1] started"), std::string::npos) << out2;
}

// The rendezvous timeout, as a real job sees it: one line naming the address and port,
// the rank, the timeout and how many ranks joined; no libtorch backtrace.
TEST(TesseraRun, RendezvousTimeoutIsOneClearLine) {
  const int port = tessera::testing::free_port();
  const std::string common = std::string("TESSERA_TEST_TIMEOUT_MS=1500 ") + TESSERA_CLI +
                             " run -n 1 --nnodes 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port);
  // Node 0 alone: rank 0 hosts the store, rank 1 never comes.
  auto [code, out] = run_command(common + " --node-rank 0 -- " + TESSERA_WORKER + " collectives");
  EXPECT_EQ(code, 3) << out;
  const std::string want = "rendezvous at 127.0.0.1:" + std::to_string(port) +
                           " timed out after 1.5 s on rank 0: 1 of 2 ranks joined";
  EXPECT_NE(out.find(want), std::string::npos) << out;
  EXPECT_EQ(out.find("Exception raised from"), std::string::npos) << out;
  EXPECT_EQ(out.find("frame #"), std::string::npos) << out;
  // Node 1 alone: nothing answers at the address.
  auto [code2, out2] = run_command(common + " --node-rank 1 -- " + TESSERA_WORKER + " collectives");
  EXPECT_EQ(code2, 3) << out2;
  const std::string want2 = "rank 1 could not reach the rendezvous store at 127.0.0.1:" + std::to_string(port) +
                            " (MASTER_ADDR:MASTER_PORT) within the timeout of 1.5 s";
  EXPECT_NE(out2.find(want2), std::string::npos) << out2;
  EXPECT_EQ(out2.find("Exception raised from"), std::string::npos) << out2;
  EXPECT_EQ(out2.find("frame #"), std::string::npos) << out2;
}
