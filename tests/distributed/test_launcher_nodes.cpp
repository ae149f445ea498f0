// The launchers' rounds across nodes (`tessera run --nnodes 2 --max-restarts`), with two
// launchers on this host meeting over loopback: a signal while they wait for each other, a
// node 0 that stops answering (a relay cut like a partition), and a failure after another
// node's ranks all exited 0. Ports are free ones, no test sleeps for a guessed time: each
// waits for what it needs to see, bounded.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/test_util.h"

namespace {

sockaddr_in loopback(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

// A socket listening on a free loopback port (backlog: the kernel completes connections
// nobody accepts yet).
int listen_on_free_port(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = loopback(0);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 64) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0)
    return ::close(fd), -1;
  *port = ntohs(a.sin_port);
  return fd;
}

// Whether something accepts connections at 127.0.0.1:port within `ms`.
bool accepts_within(int port, int ms) {
  for (const int64_t end = tessera::testing::steady_ms() + ms; tessera::testing::steady_ms() < end;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(port);
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// A `tessera run` a test started: waited for at most as long as asked, and killed with its
// process group at the end of the test if it has not ended (a launcher that hangs fails
// the test instead of leaving it waiting).
struct Launcher {
  tessera::testing::Child c;
  int status = -1;  // its wait status once it ended
  bool ended() const { return status != -1; }
  bool wait(int ms) {
    if (!ended()) status = c.wait_exit(ms);
    return ended();
  }
  int exit_code() const { return ended() && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
  ~Launcher() {
    if (c.pid > 0 && !ended()) ::kill(-c.pid, SIGKILL), c.wait_exit(10000);
  }
};

// `tessera run` as node `node` of 2 on this host (one rank each) with node 0's launcher at
// 127.0.0.1:`port`, with `flags`, running `program`.
Launcher start_node(int node, int port, const std::vector<std::string>& flags,
                    const std::vector<std::string>& program) {
  std::vector<std::string> cmd = {TESSERA_CLI,     "run",       "-n",          "1",
                                  "--nnodes",      "2",         "--node-rank", std::to_string(node),
                                  "--master-addr", "127.0.0.1", "--master-port", std::to_string(port),
                                  "--deadline",    "120"};
  cmd.insert(cmd.end(), flags.begin(), flags.end());
  cmd.push_back("--");
  cmd.insert(cmd.end(), program.begin(), program.end());
  return Launcher{tessera::testing::spawn(cmd, {{"TESSERA_TEST_TIMEOUT_MS", "30000"}})};
}

// Waits for both launchers (node 1's up to 90 s, then node 0's up to 30 s) and returns both
// outputs, for the failure messages.
std::string wait_both(Launcher& n0, Launcher& n1) {
  n1.wait(90000);
  n0.wait(30000);
  return "--- node 0:\n" + n0.c.text + "\n--- node 1:\n" + n1.c.text;
}

}  // namespace

// Ctrl-C / SIGTERM while node 0's launcher waits for a node that does not come (joining the
// first round): it stops at once with 128+signal, starting no rank, instead of after
// --rdzv-timeout (120 s here).
TEST(TesseraRun, SignalWhileWaitingForAMissingNodeEndsTheLaunchAt143) {
  const int port = tessera::testing::free_port();
  Launcher n0 = start_node(0, port, {"--max-restarts", "1", "--rdzv-timeout", "120"}, {"sh", "-c", "echo started"});
  ASSERT_GT(n0.c.pid, 0);
  // The store listens: the launcher is past installing its signal handlers, and waits.
  ASSERT_TRUE(accepts_within(port, 30000)) << "node 0's launcher never listened on " << port;
  const int64_t t0 = tessera::testing::steady_ms();
  ::kill(n0.c.pid, SIGTERM);
  ASSERT_TRUE(n0.wait(10000)) << "node 0's launcher ignored SIGTERM while waiting for node 1\n" << n0.c.text;
  EXPECT_EQ(n0.exit_code(), 128 + SIGTERM) << n0.c.text;
  EXPECT_LT(tessera::testing::steady_ms() - t0, 8000) << n0.c.text;
  EXPECT_NE(n0.c.text.find("tessera run: received signal 15 (Terminated) while no rank runs; stopping"),
            std::string::npos)
      << n0.c.text;
  EXPECT_EQ(n0.c.text.find("started"), std::string::npos) << "a round started after the signal\n" << n0.c.text;
}

// The same on node 1 while node 0 takes its connection but never answers (a stalled or
// partitioned node 0): the store call waits on another thread; the launcher stops at once.
TEST(TesseraRun, SignalWhileNode0DoesNotAnswerEndsTheLaunchAt143) {
  int port = 0;
  const int hole = listen_on_free_port(&port);
  ASSERT_GE(hole, 0);
  Launcher n1 = start_node(1, port, {"--max-restarts", "1", "--rdzv-timeout", "120"}, {"sh", "-c", "echo started"});
  ASSERT_GT(n1.c.pid, 0);
  pollfd p{hole, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 30000), 1) << "node 1's launcher never connected\n" << n1.c.text;
  const int conn = ::accept(hole, nullptr, nullptr);  // held open, never answered
  const int64_t t0 = tessera::testing::steady_ms();
  ::kill(n1.c.pid, SIGTERM);
  const bool ended = n1.wait(10000);
  ::close(conn);
  ::close(hole);
  ASSERT_TRUE(ended) << "node 1's launcher ignored SIGTERM while node 0 did not answer\n" << n1.c.text;
  EXPECT_EQ(n1.exit_code(), 128 + SIGTERM) << n1.c.text;
  EXPECT_LT(tessera::testing::steady_ms() - t0, 8000) << n1.c.text;
  EXPECT_EQ(n1.c.text.find("started"), std::string::npos) << n1.c.text;
}

// A node's rank fails after the other node's ranks all exited 0: node 0's launcher, waiting
// for the round's end, learns of the failure and starts the next round with node 1 (instead
// of exiting 0 after --rdzv-timeout and leaving node 1 to wait for it).
TEST(TesseraRun, FailureAfterAnotherNodeFinishedRestartsEveryNode) {
  const int port = tessera::testing::free_port();
  const std::vector<std::string> flags = {"--max-restarts", "2", "--rdzv-timeout", "30", "--grace", "1"},
                                 program = {TESSERA_WORKER, "fail_after_done", "1", "1"};
  Launcher n0 = start_node(0, port, flags, program), n1 = start_node(1, port, flags, program);
  ASSERT_GT(n0.c.pid, 0);
  ASSERT_GT(n1.c.pid, 0);
  const int64_t t0 = tessera::testing::steady_ms();
  const std::string both = wait_both(n0, n1);
  EXPECT_EQ(n0.exit_code(), 0) << both;
  EXPECT_EQ(n1.exit_code(), 0) << both;
  EXPECT_NE(n1.c.text.find("[rank 1] failing after another node finished round 0"), std::string::npos) << both;
  EXPECT_NE(n0.c.text.find("tessera run: node 1: rank 1 (pid "), std::string::npos) << both;
  EXPECT_NE(n0.c.text.find("exited with code 5; this node's ranks had all exited 0"), std::string::npos) << both;
  for (const Launcher* n : {&n0, &n1})
    EXPECT_NE(n->c.text.find("restart 1 of at most 2: starting every rank again"), std::string::npos) << both;
  EXPECT_NE(n0.c.text.find("[rank 0] restart count 1 rank 0 of 2 reduced 1"), std::string::npos) << both;
  EXPECT_NE(n1.c.text.find("[rank 1] restart count 1 rank 1 of 2 reduced 1"), std::string::npos) << both;
  EXPECT_LT(tessera::testing::steady_ms() - t0, 30000) << "a launcher waited out --rdzv-timeout\n" << both;
}

// The same with no restart left: the job fails on both nodes (node 0 with 1, node 1 with
// its rank's code) instead of node 0 exiting 0.
TEST(TesseraRun, FailureAfterAnotherNodeFinishedWithNoRestartLeftFailsTheJob) {
  const int port = tessera::testing::free_port();
  const std::vector<std::string> flags = {"--max-restarts", "1", "--rdzv-timeout", "30", "--grace", "1"},
                                 program = {TESSERA_WORKER, "fail_after_done", "1", "2"};
  Launcher n0 = start_node(0, port, flags, program), n1 = start_node(1, port, flags, program);
  ASSERT_GT(n0.c.pid, 0);
  ASSERT_GT(n1.c.pid, 0);
  const std::string both = wait_both(n0, n1);
  EXPECT_EQ(n0.exit_code(), 1) << both;
  EXPECT_EQ(n1.exit_code(), 5) << both;
  EXPECT_NE(n1.c.text.find("[rank 1] failing after another node finished round 1"), std::string::npos) << both;
  for (const Launcher* n : {&n0, &n1})
    EXPECT_NE(n->c.text.find("giving up: the job failed 2 time(s) and --max-restarts is 1"), std::string::npos)
        << both;
}
