// Who may reach a job's rendezvous store (issue 44 item 6): the store of a job on one node
// (rank 0's, or the launcher's with --max-restarts) is tied to the interface of MASTER_ADDR,
// so a client that comes through another interface of the host, as one from another
// machine would, is refused, while the job's own ranks meet through it as before.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "distributed/store_test_util.h"
#include "reliability/reliability_util.h"
#include "support/build_paths.h"
#include "support/test_util.h"
#include "tessera/distributed/store_listen.h"

using tessera::testing::connect_errno;
using tessera::testing::outside_address;
using tessera::testing::outside_client;

TEST(StoreListen, InterfaceOfAnAddress) {
  using tessera::distributed::interface_of;
  const std::string lo = interface_of("127.0.0.1");
  EXPECT_FALSE(lo.empty());
  EXPECT_EQ(interface_of("127.0.0.2"), lo);  // all of 127/8 arrives on loopback
  EXPECT_EQ(interface_of("localhost"), lo);
  EXPECT_EQ(interface_of("203.0.113.9"), "");  // TEST-NET-3: not this host's
  const std::string outside = outside_address();
  if (!outside.empty()) {
    EXPECT_FALSE(interface_of(outside).empty()) << outside;
    EXPECT_NE(interface_of(outside), lo) << outside;
  }
}

// A one-node job's store, rank 0's (no --max-restarts) and the launcher's (with it): the
// job's ranks meet through it at 127.0.0.1, a connection to the same port through another
// interface of this host is refused, and so is a plain c10d client there.
TEST(StoreListen, OneNodeStoreRefusesClientsFromOtherInterfaces) {
  const std::string outside = outside_address();
  if (outside.empty()) GTEST_SKIP() << "this host has no address outside loopback to come from";
  for (const bool restarts : {false, true}) {
    const int port = tessera::testing::free_port();
    const std::string dir = tessera::testing::temp_dir("tessera-store-listen");
    const std::string go = dir + "/go";
    std::vector<std::string> cmd = {TESSERA_CLI, "run", "-n", "2", "--master-port", std::to_string(port),
                                    "--deadline", "120"};
    if (restarts) cmd.insert(cmd.end(), {"--max-restarts", "1"});
    cmd.insert(cmd.end(), {"--", TESSERA_WORKER, "hold_store", go});
    tessera::testing::Child job = tessera::testing::spawn(cmd, {{"TESSERA_TEST_TIMEOUT_MS", "60000"}});
    ASSERT_GT(job.pid, 0);
    const std::string what = restarts ? "the launcher's store" : "rank 0's store";
    const bool ready = job.wait_for("store ready rank 0", 60000) && job.wait_for("store ready rank 1", 30000);
    EXPECT_TRUE(ready) << what << "\n" << job.text;
    if (ready) {
      EXPECT_EQ(connect_errno("127.0.0.1", port), 0) << what << ": the job's own address does not answer";
      EXPECT_EQ(connect_errno(outside, port), ECONNREFUSED)
          << what << " answers at " << outside << ":" << port << ": " << std::strerror(connect_errno(outside, port));
      const std::string client = outside_client(outside, port);
      EXPECT_EQ(client.rfind("refused", 0), 0u) << what << ": an outside c10d client " << client;
    }
    tessera::testing::write_bytes(go, "1");
    const int st = job.wait_exit(60000);
    if (st == -1) ::kill(-job.pid, SIGKILL), job.wait_exit(10000);
    EXPECT_TRUE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0) << what << "\n" << job.text;
    EXPECT_EQ(job.text.find("warning"), std::string::npos) << job.text;
  }
}
