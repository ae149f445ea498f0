// The launcher's signal and reaping races (issue 44 items 10 and 11): a signal while a
// failed round is being stopped, a signal right after a failure with restarts left, the
// order of killing a rank's process group and reaping the rank, and a stopped guard
// process at the end of a job.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/test_util.h"
#include "tessera/distributed/launch/launcher.h"

namespace {

// The state letter of /proc/<pid>/stat ('Z' for a zombie), or 0 when there is no such process.
char proc_state(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return 0;
  const auto p = s.rfind(')');
  return p != std::string::npos && p + 2 < s.size() ? s[p + 2] : 0;
}

// The parent pid in /proc/<pid>/stat, or -1.
int parent_of(int pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s;
  if (!std::getline(f, s)) return -1;
  const auto p = s.rfind(')');
  if (p == std::string::npos) return -1;
  char state = 0;
  int ppid = -1;
  return std::sscanf(s.c_str() + p + 1, " %c %d", &state, &ppid) == 2 ? ppid : -1;
}

// The children of `parent` (a scan of /proc).
std::vector<int> children_of(int parent) {
  std::vector<int> out;
  DIR* d = ::opendir("/proc");
  if (!d) return out;
  while (const dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (end != e->d_name && *end == '\0' && parent_of(static_cast<int>(pid)) == parent) out.push_back(static_cast<int>(pid));
  }
  ::closedir(d);
  return out;
}

int number_after(const std::string& text, const std::string& word) {
  const auto p = text.find(word);
  return p == std::string::npos ? -1 : std::atoi(text.c_str() + p + word.size());
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

// A rank that ended is reaped only after its process group was killed (while the rank is a
// zombie its pid, the group's id, cannot be another process's): the launcher's own system
// calls, as strace sees them, show kill(-pid, SIGKILL) before the wait that reaps pid.
TEST(LauncherSignals, RankGroupIsKilledBeforeTheRankIsReaped) {
  if (std::system("strace -V >/dev/null 2>&1") != 0) GTEST_SKIP() << "strace is not installed";
  const std::string dir = tessera::testing::temp_dir("tessera-reap-order");
  const std::string trace = dir + "/trace";
  auto [code, out] = tessera::testing::run_command(
      "strace -f -qq -e trace=kill,wait4,waitid -o " + trace + " " + TESSERA_CLI + " run -n 2 --grace 5 -- " +
      TESSERA_WORKER + " exit_code 1 3 0 ready");
  const std::string t = tessera::testing::read_bytes(trace);
  if (code != 3 && (out.find("ptrace") != std::string::npos || out.find("PTRACE") != std::string::npos))
    GTEST_SKIP() << "strace cannot trace here: " << out;
  ASSERT_EQ(code, 3) << out;
  std::vector<std::string> lines;
  for (size_t p = 0, q; p < t.size(); p = q + 1) {
    q = t.find('\n', p);
    if (q == std::string::npos) q = t.size();
    lines.push_back(t.substr(p, q - p));
  }
  for (int r : {0, 1}) {
    const int pid = number_after(out, "hello from rank " + std::to_string(r) + " pid ");
    ASSERT_GT(pid, 0) << out;
    long killed = -1, reaped = -1;
    const std::string kill_call = "kill(-" + std::to_string(pid) + ", SIGKILL)";
    const std::regex reap("wait4.*= " + std::to_string(pid) + "$");
    for (size_t i = 0; i < lines.size(); ++i) {
      if (killed < 0 && lines[i].find(kill_call) != std::string::npos) killed = static_cast<long>(i);
      if (reaped < 0 && std::regex_search(lines[i], reap)) reaped = static_cast<long>(i);
    }
    ASSERT_GE(reaped, 0) << "rank " << r << " (pid " << pid << ") was not seen reaped\n" << t;
    ASSERT_GE(killed, 0) << "rank " << r << "'s group was not killed\n" << t;
    EXPECT_LT(killed, reaped) << "rank " << r << " (pid " << pid << ") was reaped before its group was killed:\n"
                              << lines[static_cast<size_t>(reaped)] << "\n" << lines[static_cast<size_t>(killed)];
  }
}

// A SIGSTOP that hits the launcher's guard process (its child beside the ranks) does not
// keep the launcher from ending once the job is done.
TEST(LauncherSignals, StoppedGuardDoesNotHoldTheLauncher) {
  const std::string dir = tessera::testing::temp_dir("tessera-stopped-guard");
  const std::string go = dir + "/go";
  tessera::testing::Child job = tessera::testing::spawn(
      {TESSERA_CLI, "run", "-n", "1", "--max-restarts", "1", "--", "sh", "-c",
       "echo rank pid $$; while [ ! -e " + go + " ]; do sleep 0.01; done; echo done step=500"});
  ASSERT_GT(job.pid, 0);
  ASSERT_TRUE(job.wait_for("rank pid ", 60000)) << job.text;
  const int rank = number_after(job.text, "rank pid ");
  ASSERT_GT(rank, 0) << job.text;
  std::vector<int> guards;
  for (int pid : children_of(job.pid))
    if (pid != rank) guards.push_back(pid);
  ASSERT_EQ(guards.size(), 1u) << "the launcher's children besides rank " << rank;
  const int guard = guards[0];
  ASSERT_EQ(::kill(guard, SIGSTOP), 0);
  tessera::testing::write_bytes(go, "1");
  const int st = job.wait_exit(30000);
  if (st == -1) {
    // Held by its guard: continued, the guard reads the launcher's goodbye and both end. The
    // guard's pid is safe to signal while the launcher, its parent, has not reaped it.
    ::kill(guard, SIGCONT);
    if (job.wait_exit(30000) == -1) ::kill(guard, SIGKILL), ::kill(-job.pid, SIGKILL), job.wait_exit(10000);
  }
  ASSERT_NE(st, -1) << "the launcher waited for its stopped guard\n" << job.text;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << job.text;
  EXPECT_NE(job.text.find("done step=500"), std::string::npos) << job.text;
}
