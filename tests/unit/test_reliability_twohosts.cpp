// Reliability: two "hosts" on one machine. Two network namespaces joined by a veth
// pair; one `tessera run --nnodes 2 --node-rank i -n 2` in each, so the rendezvous and
// every Gloo connection between the nodes cross the veth link (the master address
// exists only in the first namespace). The 4 ranks train with hybrid sharding (shard
// inside a node, replicate across nodes) and check loss and parameter parity with a
// one-process run (strategy_parity). Needs root and iproute2 (`ip netns`); skipped
// with the reason otherwise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cctype>
#include <iostream>

#include "test_reliability_util.h"
#include "test_util.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

struct Netns {
  std::string a, b, va, vb, ip_a, ip_b;
  bool up = false;
  ~Netns() {
    if (!a.empty()) run_command("ip netns del " + a);
    if (!b.empty()) run_command("ip netns del " + b);
  }
};

}  // namespace

TEST(ReliabilityTwoHosts, HybridShardingAcrossTwoNetworkNamespacesMatchesOneProcess) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces (ip netns add)";
  auto [ip_rc, ip_path] = run_command("command -v ip");
  if (ip_rc != 0) GTEST_SKIP() << "iproute2 (the `ip` tool) is not installed (scripts/setup.sh installs it)";
  while (!ip_path.empty() && std::isspace(static_cast<unsigned char>(ip_path.back()))) ip_path.pop_back();
  const std::string tag = std::to_string(::getpid() % 100000);
  Netns ns;
  ns.a = "tsA" + tag;
  ns.b = "tsB" + tag;
  ns.va = "tva" + tag;
  ns.vb = "tvb" + tag;
  const std::string net = "10.211." + std::to_string(::getpid() % 250) + ".";
  ns.ip_a = net + "1";
  ns.ip_b = net + "2";
  auto [rc, out] = run_command("ip netns add " + ns.a);
  if (rc != 0) {
    ns.a.clear();
    ns.b.clear();
    GTEST_SKIP() << "cannot create a network namespace here: " << out;
  }
  const std::vector<std::string> setup = {
      "ip netns add " + ns.b,
      "ip link add " + ns.va + " type veth peer name " + ns.vb,
      "ip link set " + ns.va + " netns " + ns.a,
      "ip link set " + ns.vb + " netns " + ns.b,
      "ip -n " + ns.a + " addr add " + ns.ip_a + "/24 dev " + ns.va,
      "ip -n " + ns.b + " addr add " + ns.ip_b + "/24 dev " + ns.vb,
      "ip -n " + ns.a + " link set " + ns.va + " up",
      "ip -n " + ns.b + " link set " + ns.vb + " up",
      "ip -n " + ns.a + " link set lo up",
      "ip -n " + ns.b + " link set lo up"};
  for (const auto& cmd : setup) {
    auto [c, o] = run_command(cmd);
    if (c != 0) GTEST_SKIP() << "cannot set up the veth pair (" << cmd << "): " << o;
  }
  const std::string port = std::to_string(20000 + ::getpid() % 20000);
  auto node = [&](int i) {
    const std::string& n = i == 0 ? ns.a : ns.b;
    return spawn({ip_path, "netns", "exec", n, TESSERA_CLI, "run", "--nnodes", "2", "--node-rank",
                  std::to_string(i), "-n", "2", "--master-addr", ns.ip_a, "--master-port", port, "--deadline", "240",
                  "--", TESSERA_WORKER, "strategy_parity", "hybrid", "10"},
                 {{"GLOO_SOCKET_IFNAME", i == 0 ? ns.va : ns.vb}, {"TESSERA_TEST_TIMEOUT_MS", "60000"}});
  };
  const int64_t t0 = steady_ms();
  Child n0 = node(0), n1 = node(1);
  ASSERT_GT(n0.pid, 0);
  ASSERT_GT(n1.pid, 0);
  const int s0 = n0.wait_exit(300000), s1 = n1.wait_exit(300000);
  if (s0 == -1) ::kill(-n0.pid, SIGKILL), n0.wait_exit(10000);
  if (s1 == -1) ::kill(-n1.pid, SIGKILL), n1.wait_exit(10000);
  const std::string both = "--- node 0:\n" + n0.text + "\n--- node 1:\n" + n1.text;
  ASSERT_TRUE(s0 != -1 && s1 != -1) << "a node did not finish\n" << both;
  EXPECT_TRUE(WIFEXITED(s0) && WEXITSTATUS(s0) == 0) << both;
  EXPECT_TRUE(WIFEXITED(s1) && WEXITSTATUS(s1) == 0) << both;
  // Global ranks 0, 1 on node 0 and 2, 3 on node 1, each at parity with one process.
  for (int r : {0, 1}) EXPECT_NE(n0.text.find("parity ok rank " + std::to_string(r)), std::string::npos) << both;
  for (int r : {2, 3}) EXPECT_NE(n1.text.find("parity ok rank " + std::to_string(r)), std::string::npos) << both;
  EXPECT_NE(n1.text.find("hybrid n=4"), std::string::npos) << both;
  std::cout << "[twohosts] 2 namespaces x 2 ranks, hybrid sharding, 10 steps: " << steady_ms() - t0 << " ms"
            << std::endl;
}
