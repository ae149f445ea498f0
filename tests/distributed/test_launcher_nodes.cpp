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

// A TCP relay on a free loopback port to node 0's port: what node 1's launcher and ranks
// reach as node 0. cut() makes it a network partition: from then on nothing passes either
// way and no connection is closed, so a call to node 0 is neither answered nor refused.
// unanswered(): since the cut, a launchers' lookup (a request naming "tessera/launch/")
// was swallowed, or the answer to one.
class Relay {
 public:
  explicit Relay(int to_port) : to_port_(to_port) {
    listen_ = listen_on_free_port(&port_);
    thread_ = std::thread([this] { run(); });
  }
  ~Relay() {
    quit_ = true;
    thread_.join();
    for (const Link& l : links_)
      for (int fd : {l.from, l.to})
        if (fd >= 0) ::close(fd);
    ::close(listen_);
  }
  int port() const { return port_; }
  void cut() { cut_ = true; }
  bool unanswered() const { return unanswered_; }

 private:
  struct Link {
    int from = -1, to = -1;     // node 1's end, node 0's end
    bool launcher_asked = false;  // the last request relayed was a launchers' lookup
    std::string tail;             // the end of what node 1 sent (a key split across reads)
  };

  void run() {
    while (!quit_) {
      std::vector<pollfd> fds{{listen_, POLLIN, 0}};
      for (const Link& l : links_) {
        fds.push_back({l.from, POLLIN, 0});
        fds.push_back({l.to, POLLIN, 0});  // -1: ignored by poll
      }
      if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
      for (size_t i = 0; i < links_.size(); ++i) {
        for (int side = 0; side < 2; ++side)
          if (fds[1 + 2 * i + side].revents & (POLLIN | POLLHUP | POLLERR)) relay(links_[i], side == 0);
      }
      if (fds[0].revents & POLLIN) {
        Link l;
        l.from = ::accept(listen_, nullptr, nullptr);
        sockaddr_in a = loopback(to_port_);
        l.to = ::socket(AF_INET, SOCK_STREAM, 0);
        if (cut_ || ::connect(l.to, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) ::close(l.to), l.to = -1;
        links_.push_back(l);
      }
    }
  }

  void relay(Link& l, bool from_node1) {
    char buf[65536];
    const ssize_t n = ::read(from_node1 ? l.from : l.to, buf, sizeof buf);
    if (n <= 0) {  // an end closed: so does the other
      for (int* fd : {&l.from, &l.to})
        if (*fd >= 0) ::close(*fd), *fd = -1;
      return;
    }
    const std::string data(buf, static_cast<size_t>(n));
    if (from_node1) {
      const std::string seen = l.tail + data;
      l.tail = seen.substr(seen.size() > 16 ? seen.size() - 16 : 0);
      const bool lookup = seen.find("tessera/launch/") != std::string::npos;
      if (cut_) {
        if (lookup) unanswered_ = true;
        return;
      }
      l.launcher_asked = lookup;
    } else if (cut_) {
      if (l.launcher_asked) unanswered_ = true;
      return;
    }
    const int to = from_node1 ? l.to : l.from;
    for (ssize_t done = 0, k = 0; to >= 0 && done < n; done += k)
      if ((k = ::write(to, buf + done, static_cast<size_t>(n - done))) <= 0) break;
  }

  int to_port_, port_ = 0, listen_ = -1;
  std::vector<Link> links_;  // the relay thread's
  std::atomic<bool> quit_{false}, cut_{false}, unanswered_{false};
  std::thread thread_;
};

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

// Node 0 partitioned from node 1 while node 1's ranks run (a relay that stops passing
// anything, connections left open): node 1's launcher goes on reading its ranks' output (a
// rank writes 1 MiB, more than its pipe holds, after the launcher's lookup went
// unanswered), and after --rdzv-timeout without an answer it stops its ranks and exits 1
// naming node 0.
TEST(TesseraRun, SilentNode0HoldsUpNeitherOutputNorExitsAndIsNamed) {
  const std::string dir = tessera::testing::temp_dir("tessera-run-partition"), go = dir + "/go";
  const int port = tessera::testing::free_port();
  Relay relay(port);
  // --rdzv-timeout 15: node 0 may take seconds to start on a loaded machine, and node 1's
  // launcher gives up on a node 0 that has not answered for that long.
  const std::vector<std::string> flags = {"--max-restarts", "1", "--rdzv-timeout", "15", "--grace", "1"},
                                 program = {TESSERA_WORKER, "flood_on", go, "1048576"};
  Launcher n0 = start_node(0, port, flags, program), n1 = start_node(1, relay.port(), flags, program);
  ASSERT_GT(n0.c.pid, 0);
  ASSERT_GT(n1.c.pid, 0);
  ASSERT_TRUE(n1.c.wait_for("[rank 1] met rank 1", 60000)) << "--- node 0:\n" << n0.c.text << "\n--- node 1:\n"
                                                            << n1.c.text;
  relay.cut();
  for (const int64_t end = tessera::testing::steady_ms() + 5000;
       !relay.unanswered() && tessera::testing::steady_ms() < end;)
    n1.c.pump(20);
  ASSERT_TRUE(relay.unanswered()) << "node 1's launcher looked nothing up in node 0's store\n" << n1.c.text;
  const int64_t t_go = tessera::testing::steady_ms();
  tessera::testing::write_bytes(go, "");
  EXPECT_TRUE(n1.c.wait_for("[rank 1] flooded 1048576 bytes rank 1", 3000))
      << "node 1's launcher stopped reading its rank's output while node 0 did not answer ("
      << tessera::testing::steady_ms() - t_go << " ms)";
  ASSERT_TRUE(n1.wait(60000)) << "node 1's launcher did not end after node 0 went silent";
  EXPECT_EQ(n1.exit_code(), 1);
  const size_t flooded = n1.c.text.rfind("flooded");
  const std::string tail = n1.c.text.substr(flooded == std::string::npos ? 0 : flooded);
  EXPECT_NE(tail.find("tessera run: node 0's launcher (the launchers' store at 127.0.0.1:" +
                      std::to_string(relay.port()) + ") has not answered for 15 s (--rdzv-timeout)"),
            std::string::npos)
      << tail;
  EXPECT_NE(tail.find("stopping this node's ranks"), std::string::npos) << tail;
  EXPECT_EQ(tail.find("restart 1 of at most 1"), std::string::npos) << "restarted without node 0\n" << tail;
  ::kill(n0.c.pid, SIGTERM);
  EXPECT_TRUE(n0.wait(15000)) << n0.c.text;
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
  n1.wait(90000);
  n0.wait(30000);
  const std::string both = "--- node 0:\n" + n0.c.text + "\n--- node 1:\n" + n1.c.text;
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
  n1.wait(90000);
  n0.wait(30000);
  const std::string both = "--- node 0:\n" + n0.c.text + "\n--- node 1:\n" + n1.c.text;
  EXPECT_EQ(n0.exit_code(), 1) << both;
  EXPECT_EQ(n1.exit_code(), 5) << both;
  EXPECT_NE(n1.c.text.find("[rank 1] failing after another node finished round 1"), std::string::npos) << both;
  for (const Launcher* n : {&n0, &n1})
    EXPECT_NE(n->c.text.find("giving up: the job failed 2 time(s) and --max-restarts is 1"), std::string::npos)
        << both;
}
