// The launcher's signal races (issue 44 item 10): a signal while a failed round is being
// stopped, and a signal right after a failure with restarts left.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "reliability/reliability_util.h"
#include "support/test_util.h"
#include "tessera/distributed/launcher.h"

namespace {

// The state letter of /proc/<pid>/stat ('Z' for a zombie), or 0 when there is no such process.
char proc_state(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return 0;
  const auto p = s.rfind(')');
  return p != std::string::npos && p + 2 < s.size() ? s[p + 2] : 0;
}

}  // namespace

// SIGTERM to `tessera run` while it stops the other ranks after one was killed (rank 0 is
// deaf to the launcher's TERM and waits for its KILL): the launch ends with 143, as any
// launch a SIGTERM ended, not with the killed rank's 137.
TEST(LauncherSignals, TermWhileAFailedRoundIsStoppedExitsWith143) {
  tessera::testing::Child job = tessera::testing::spawn(
      {TESSERA_CLI, "run", "-n", "2", "--grace", "10", "--", TESSERA_WORKER, "exit_code", "1", "-9", "0", "deaf"});
  ASSERT_GT(job.pid, 0);
  ASSERT_TRUE(job.wait_for("stopping the other ranks", 60000)) << job.text;
  ASSERT_TRUE(job.wait_for("deaf to TERM rank 0", 10000)) << job.text;
  ::kill(job.pid, SIGTERM);
  const int st = job.wait_exit(60000);
  if (st == -1) ::kill(-job.pid, SIGKILL), job.wait_exit(10000);
  ASSERT_NE(st, -1) << "the launcher did not end\n" << job.text;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 128 + SIGTERM)
      << "exit status " << (WIFEXITED(st) ? WEXITSTATUS(st) : -1) << "\n" << job.text;
  EXPECT_NE(job.text.find("received signal 15"), std::string::npos) << job.text;
}

// SIGINT that arrives once the failed round's ranks have all exited, before the launcher
// decides on the restart (raised from the launcher's own thread while it reads the failing
// rank's last line, after that rank has exited): no restart is counted or announced, and
// the launch ends with 130.
TEST(LauncherSignals, InterruptRightAfterAFailureStartsNoRestart) {
  tessera::distributed::LaunchOptions o;
  o.command = {TESSERA_WORKER, "last_words"};
  o.nproc_per_node = 1;
  o.max_restarts = 3;
  o.deadline = std::chrono::seconds(60);
  o.forward_signals = true;
  int pid = -1, last_words = 0;
  bool exited_before_the_signal = false;
  o.on_line = [&](int, bool, const std::string& line) {
    if (line.rfind("pid ", 0) == 0) pid = std::atoi(line.c_str() + 4);
    if (line == "last words") {
      ++last_words;
      // The rank exits right after writing its lines; wait (bounded) until it has.
      for (int i = 0; i < 1000 && pid > 0 && proc_state(pid) != 'Z'; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      exited_before_the_signal = pid > 0 && proc_state(pid) == 'Z';
    }
    if (line == "exiting 5") ::raise(SIGINT);
  };
  const tessera::distributed::LaunchResult r = tessera::distributed::launch(o);
  ASSERT_TRUE(exited_before_the_signal) << "the rank had not exited when the signal came";
  EXPECT_EQ(r.restarts, 0) << r.message;
  EXPECT_EQ(last_words, 1) << "a round was started after the signal";
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.message;
}
