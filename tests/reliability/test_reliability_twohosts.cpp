// Reliability: two "hosts" on one machine. Two network namespaces joined by a veth
// pair; one `tessera run --nnodes 2 --node-rank i -n 2` in each, so the rendezvous and
// every Gloo connection between the nodes cross the veth link (the master address
// exists only in the first namespace). The 4 ranks use hybrid sharding (shard inside a
// node, replicate across nodes):
//  - training matches a one-process run (strategy_parity);
//  - a sharded checkpoint saved by both nodes (one writer per box) verifies, reads back
//    bit for bit, and resumes across the two nodes and at other world sizes;
//  - and a (dp 2, tp 2) mesh: tensor parallelism inside each host, FSDP across.
// Needs root and iproute2 (`ip netns`, installed by scripts/setup.sh). Without root it
// is skipped with the reason; as root (CI) a setup failure is a test failure, never a
// skip, so the test cannot silently stop running.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <iostream>

#include "support/build_paths.h"
#include "reliability/reliability_util.h"
#include "support/harness.h"
#include "support/test_util.h"
#include "tessera/checkpoint/offline/offline.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

class ReliabilityTwoHosts : public ::testing::Test {
 protected:
  std::string ip_path, a, b, va, vb, ip_a, ip_b;

  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces (ip netns add)";
    // As root from here on: every failure to set up fails the test.
    auto [ip_rc, path] = run_command("command -v ip");
    ASSERT_EQ(ip_rc, 0) << "running as root but iproute2 (the `ip` tool) is missing: install it (scripts/setup.sh "
                           "does) — this test must run where it can";
    ip_path = path;
    while (!ip_path.empty() && std::isspace(static_cast<unsigned char>(ip_path.back()))) ip_path.pop_back();
    const std::string tag = std::to_string(::getpid() % 100000);
    const std::string net = "10.211." + std::to_string(::getpid() % 250) + ".";
    ip_a = net + "1";
    ip_b = net + "2";
    va = "tva" + tag;
    vb = "tvb" + tag;
    const std::vector<std::pair<std::string*, std::string>> spaces = {{&a, "tsA" + tag}, {&b, "tsB" + tag}};
    for (auto& [slot, name] : spaces) {
      auto [rc, out] = run_command("ip netns add " + name);
      ASSERT_EQ(rc, 0) << "running as root but cannot create network namespace " << name
                       << " (does the container lack CAP_NET_ADMIN?): " << out;
      *slot = name;  // removed in TearDown
    }
    const std::vector<std::string> setup = {"ip link add " + va + " type veth peer name " + vb,
                                            "ip link set " + va + " netns " + a,
                                            "ip link set " + vb + " netns " + b,
                                            "ip -n " + a + " addr add " + ip_a + "/24 dev " + va,
                                            "ip -n " + b + " addr add " + ip_b + "/24 dev " + vb,
                                            "ip -n " + a + " link set " + va + " up",
                                            "ip -n " + b + " link set " + vb + " up",
                                            "ip -n " + a + " link set lo up",
                                            "ip -n " + b + " link set lo up"};
    for (const auto& cmd : setup) {
      auto [c, o] = run_command(cmd);
      ASSERT_EQ(c, 0) << "running as root but cannot set up the veth pair (" << cmd << "): " << o;
    }
  }

  void TearDown() override {
    // Deleting a namespace deletes the veth end inside it (and so the pair).
    if (!a.empty()) run_command("ip netns del " + a);
    if (!b.empty()) run_command("ip netns del " + b);
  }

  struct Nodes {
    std::string text[2];
    bool ok[2] = {false, false};
    std::string both() const { return "--- node 0:\n" + text[0] + "\n--- node 1:\n" + text[1]; }
  };

  // `tessera run` for node i of 2 in its namespace (2 ranks), with launcher flags
  // `flags`, running the worker with `args`.
  Child start_node(int i, const std::string& port, const std::vector<std::string>& args,
                   const std::vector<std::string>& flags = {}) {
    std::vector<std::string> cmd = {ip_path, "netns",     "exec", i == 0 ? a : b, TESSERA_CLI,     "run",
                                    "--nnodes", "2",      "--node-rank", std::to_string(i), "-n",  "2",
                                    "--master-addr", ip_a, "--master-port", port, "--deadline", "240"};
    cmd.insert(cmd.end(), flags.begin(), flags.end());
    cmd.push_back("--");
    cmd.push_back(TESSERA_WORKER);
    cmd.insert(cmd.end(), args.begin(), args.end());
    return spawn(cmd, {{"GLOO_SOCKET_IFNAME", i == 0 ? va : vb}, {"TESSERA_TEST_TIMEOUT_MS", "60000"}});
  }

  // Both nodes started with `args` and `flags` (start_node), and every rank of both in
  // round 0 ("restart count 0 rank R" from restart_then_reduce); when they do not meet, both
  // are killed and `met` is false.
  struct Met {
    Child n0, n1;
    bool met = false;
  };
  Met start_and_meet(const std::string& port, const std::vector<std::string>& args,
                     const std::vector<std::string>& flags) {
    Met m{start_node(0, port, args, flags), start_node(1, port, args, flags)};
    EXPECT_GT(m.n0.pid, 0);
    EXPECT_GT(m.n1.pid, 0);
    if (m.n0.pid <= 0 || m.n1.pid <= 0) return m;
    m.met = m.n1.wait_for("restart count 0 rank 3", 120000) && m.n0.wait_for("restart count 0 rank 0", 30000);
    if (!m.met) ::kill(-m.n0.pid, SIGKILL), ::kill(-m.n1.pid, SIGKILL);
    return m;
  }

  // One `tessera run` per namespace (2 ranks each) running the worker with `args`.
  Nodes run_nodes(const std::vector<std::string>& args, const std::vector<std::string>& flags = {}) {
    const std::string port = std::to_string(free_port());
    Child n0 = start_node(0, port, args, flags), n1 = start_node(1, port, args, flags);
    Nodes r;
    EXPECT_GT(n0.pid, 0);
    EXPECT_GT(n1.pid, 0);
    if (n0.pid <= 0 || n1.pid <= 0) return r;
    int st[2] = {n0.wait_exit(300000), n1.wait_exit(300000)};
    Child* c[2] = {&n0, &n1};
    for (int i = 0; i < 2; ++i) {
      if (st[i] == -1) ::kill(-c[i]->pid, SIGKILL), c[i]->wait_exit(10000);
      r.text[i] = c[i]->text;
      r.ok[i] = st[i] != -1 && WIFEXITED(st[i]) && WEXITSTATUS(st[i]) == 0;
    }
    EXPECT_TRUE(r.ok[0] && r.ok[1]) << "a node failed or did not finish\n" << r.both();
    return r;
  }
};

}  // namespace

TEST_F(ReliabilityTwoHosts, HybridShardingAcrossTwoNetworkNamespacesMatchesOneProcess) {
  const int64_t t0 = steady_ms();
  Nodes n = run_nodes({"strategy_parity", "hybrid", "10"});
  // Global ranks 0, 1 on node 0 and 2, 3 on node 1, each at parity with one process.
  for (int r : {0, 1}) EXPECT_NE(n.text[0].find("parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
  for (int r : {2, 3}) EXPECT_NE(n.text[1].find("parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
  EXPECT_NE(n.text[1].find("hybrid n=4"), std::string::npos) << n.both();
  std::cout << "[twohosts] 2 namespaces x 2 ranks, hybrid sharding, 10 steps: " << steady_ms() - t0 << " ms"
            << std::endl;
}

// A (dp 2, tp 2) mesh over the two hosts: each host's two ranks form a tensor-parallel
// group (consecutive ranks), whose collectives stay inside the host on shared memory; FSDP
// runs across the hosts (the veth link). Ten steps of the GPT example, with sequence
// parallelism, at parity with one process (parallel_scenarios.cpp).
TEST_F(ReliabilityTwoHosts, TensorParallelInsideEachHostFsdpAcrossMatchesOneProcess) {
  Nodes n = run_nodes({"tp_parity", "fsdp", "2", "sp-untied,nosp-tied", "10"});
  for (int r : {0, 1}) EXPECT_NE(n.text[0].find("tp parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
  for (int r : {2, 3}) EXPECT_NE(n.text[1].find("tp parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
  for (int i : {0, 1})
    EXPECT_NE(n.text[i].find("tp group shared memory: 1, dp group shared memory: 0"), std::string::npos) << n.both();
}

// A 3-D mesh over the two hosts, (replicate 2, shard 1, tp 2): TP inside each host, FSDP's
// HYBRID_SHARD with one replica group per host (its gradient all-reduce crosses the link).
TEST_F(ReliabilityTwoHosts, HybridShardTimesTensorParallelAcrossTwoHostsMatchesOneProcess) {
  Nodes n = run_nodes({"tp_parity", "hsdp", "2", "sp-untied", "10"});
  for (int r : {0, 1}) EXPECT_NE(n.text[0].find("tp parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
  for (int r : {2, 3}) EXPECT_NE(n.text[1].find("tp parity ok rank " + std::to_string(r)), std::string::npos) << n.both();
}

// HYBRID_SHARD with its default layout (one shard group per node, from the launcher's
// LOCAL_WORLD_SIZE): 2 replica groups, one per host. The sharded save writes each box
// once (the hosts share the writing), every rank reads its state back bit for bit, and
// the checkpoint resumes on the two hosts and on one host at world sizes 1 and 3.
TEST_F(ReliabilityTwoHosts, HybridShardedCheckpointAcrossTwoHostsSavesAndResumes) {
  const std::string dir = temp_dir("tessera-twohosts-ckpt"), ckpt = dir + "/ckpt";
  const int64_t t0 = steady_ms();
  Nodes s = run_nodes({"strategy_resume", "save", "hybrid_local", ckpt, "3"});
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(s.text[r / 2].find("saved rank " + std::to_string(r)), std::string::npos) << s.both();
  EXPECT_NE(s.text[0].find("shard group 2 of 4, replica group size 2"), std::string::npos) << s.both();
  auto v = checkpoint::verify(ckpt);
  std::string problems;
  for (const auto& p : v.problems) problems += p + "\n";
  EXPECT_TRUE(v.ok) << problems;
  Nodes l = run_nodes({"strategy_resume", "load", "hybrid_local", ckpt, "3", "3"});
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(l.text[r / 2].find("resumed ok rank " + std::to_string(r)), std::string::npos) << l.both();
  for (auto [n, kind] : std::vector<std::pair<int, std::string>>{{1, "single"}, {3, "full"}}) {
    auto res = run_ranks(n, {"strategy_resume", "load", kind, ckpt, "3", "3"}, 240);
    EXPECT_RANKS_OK(res);
    for (int r = 0; r < n; ++r)
      EXPECT_FALSE(res.out[r].empty() || res.out[r].back() != "resumed ok rank " + std::to_string(r))
          << res.all_output();
  }
  std::cout << "[twohosts] hybrid sharded checkpoint over 2 namespaces, saved and resumed: " << steady_ms() - t0
            << " ms" << std::endl;
}

// --max-restarts across nodes: rank 3 (node 1) fails in the first round; node 1's
// launcher reports it in the launchers' store, node 0's stops its ranks at once (they
// sleep: no collective would fail them), and both launchers start a new round together.
TEST_F(ReliabilityTwoHosts, MaxRestartsRestartsEveryNodeAfterOneNodesFailure) {
  const int64_t t0 = steady_ms();
  Nodes n = run_nodes({"restart_then_reduce", "3", "1"}, {"--max-restarts", "2", "--rdzv-timeout", "60"});
  EXPECT_NE(n.text[1].find("rank 3 "), std::string::npos) << n.both();
  EXPECT_NE(n.text[0].find("node 1: rank 3 "), std::string::npos) << "node 0 did not learn of node 1's failure\n"
                                                                     << n.both();
  for (int i : {0, 1}) EXPECT_NE(n.text[i].find("restart 1 of at most 2"), std::string::npos) << n.both();
  for (int r = 0; r < 4; ++r)
    EXPECT_NE(n.text[r / 2].find("restart count 1 rank " + std::to_string(r) + " of 4 reduced 6"), std::string::npos)
        << n.both();
  std::cout << "[twohosts] a rank of node 1 failed, both nodes restarted and finished: " << steady_ms() - t0 << " ms"
            << std::endl;
}

// A node's launcher killed: its ranks die with it, node 0's ranks fail in their next
// barrier, and node 0's launcher waits --rdzv-timeout for node 1 to join the restart,
// then exits non-zero naming it.
TEST_F(ReliabilityTwoHosts, KilledNodeLauncherIsNamedByTheOthers) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> args = {"restart_then_reduce", "-1", "100", "busy"},
                                 flags = {"--max-restarts", "3", "--rdzv-timeout", "5", "--grace", "1"};
  Met m = start_and_meet(port, args, flags);
  Child &n0 = m.n0, &n1 = m.n1;
  ASSERT_TRUE(m.met) << "--- node 0:\n" << n0.text << "\n--- node 1:\n" << n1.text;
  const int64_t t_kill = steady_ms();
  ::kill(n1.pid, SIGKILL);  // the launcher only: its ranks must not outlive it
  n1.wait_exit(10000);
  const int st = n0.wait_exit(60000);
  const int64_t dt = steady_ms() - t_kill;
  if (st == -1) ::kill(-n0.pid, SIGKILL), n0.wait_exit(10000);
  ASSERT_NE(st, -1) << "node 0's launcher still runs " << dt << " ms after node 1's was killed\n" << n0.text;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) != 0) << n0.text;
  EXPECT_NE(n0.text.find("node 1 did not join restart round 1 within 5 s"), std::string::npos) << n0.text;
  EXPECT_LT(dt, 30000) << n0.text;
  EXPECT_FALSE(group_alive(n0.pid));
  std::cout << "[twohosts] node 1's launcher killed: node 0 exited " << WEXITSTATUS(st) << " after " << dt
            << " ms naming it" << std::endl;
}

// Node 0 cut off (its end of the link down: packets dropped, no connection closed) while
// every rank sleeps: node 1's launcher is held up by no store call to node 0, and once one
// has gone unanswered for --rdzv-timeout it stops its ranks and exits 1 naming node 0,
// without trying a restart that could not meet.
TEST_F(ReliabilityTwoHosts, PartitionedNode0IsNamedByTheOthersAfterTheTimeout) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> args = {"restart_then_reduce", "-1", "100"},
                                 flags = {"--max-restarts", "1", "--rdzv-timeout", "5", "--grace", "1"};
  Met m = start_and_meet(port, args, flags);
  Child &n0 = m.n0, &n1 = m.n1;
  ASSERT_TRUE(m.met) << "--- node 0:\n" << n0.text << "\n--- node 1:\n" << n1.text;
  auto [rc, out] = run_command("ip -n " + a + " link set " + va + " down");
  if (rc != 0) ::kill(-n0.pid, SIGKILL), ::kill(-n1.pid, SIGKILL);
  ASSERT_EQ(rc, 0) << "cannot take node 0's link down: " << out;
  const int64_t t_cut = steady_ms();
  const int st = n1.wait_exit(60000);
  const int64_t dt = steady_ms() - t_cut;
  ::kill(-n0.pid, SIGKILL);
  n0.wait_exit(10000);
  if (st == -1) ::kill(-n1.pid, SIGKILL), n1.wait_exit(10000);
  ASSERT_NE(st, -1) << "node 1's launcher still runs " << dt << " ms after node 0 was cut off\n" << n1.text;
  EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 1) << n1.text;
  EXPECT_NE(n1.text.find("node 0's launcher (the launchers' store at " + ip_a + ":" + port +
                         ") has not answered for 5 s (--rdzv-timeout)"),
            std::string::npos)
      << n1.text;
  EXPECT_EQ(n1.text.find("restart 1 of at most 1"), std::string::npos) << n1.text;
  EXPECT_LT(dt, 30000) << n1.text;
  EXPECT_FALSE(group_alive(n1.pid));
  std::cout << "[twohosts] node 0 cut off: node 1 exited " << WEXITSTATUS(st) << " after " << dt << " ms naming it"
            << std::endl;
}
