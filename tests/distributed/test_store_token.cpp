// A rendezvous token (issue 44 item 6, store_gate.h): with TESSERA_RDZV_TOKEN or
// TESSERA_RDZV_TOKEN_FILE every launcher and rank proves the token before its first key, a
// client without it (a plain c10d client, from this host or through another interface, as a
// machine outside the job would) reads nothing, and a node with another token is refused
// with a message that says so. Two nodes are simulated on this host (--nnodes 2, 127.0.0.1).
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <chrono>
#include <string>
#include <vector>

#include "distributed/store_test_util.h"
#include "support/build_paths.h"
#include "support/child_process.h"
#include "support/test_util.h"
#include "tessera/core/error.h"
#include "tessera/distributed/store_gate.h"

namespace {

using tessera::testing::Child;
using tessera::testing::outside_address;
using tessera::testing::outside_client;

std::string hex(const std::string& raw) {
  static const char* d = "0123456789abcdef";
  std::string h;
  for (unsigned char c : raw) h += {d[c >> 4], d[c & 15]};
  return h;
}

// Sets (or unsets, for nullptr) an environment variable for the scope.
struct ScopedEnv {
  std::string name;
  std::string saved;
  bool had = false;
  ScopedEnv(std::string n, const char* value) : name(std::move(n)) {
    if (const char* v = ::getenv(name.c_str())) had = true, saved = v;
    if (value)
      ::setenv(name.c_str(), value, 1);
    else
      ::unsetenv(name.c_str());
  }
  ~ScopedEnv() {
    if (had)
      ::setenv(name.c_str(), saved.c_str(), 1);
    else
      ::unsetenv(name.c_str());
  }
};

// Node `node` of a two-node job on this host, each node one rank of the hold_store scenario.
Child start_node(int node, int port, const std::string& token_file, const std::string& go, bool restarts,
                 const std::string& timeout_ms = "60000") {
  std::vector<std::string> cmd = {TESSERA_CLI,      "run",         "-n",          "1",
                                  "--nnodes",       "2",           "--node-rank", std::to_string(node),
                                  "--master-addr",  "127.0.0.1",   "--master-port", std::to_string(port),
                                  "--deadline",     "120"};
  if (restarts) cmd.insert(cmd.end(), {"--max-restarts", "1", "--rdzv-timeout", std::to_string(std::stoi(timeout_ms) / 1000)});
  cmd.insert(cmd.end(), {"--", TESSERA_WORKER, "hold_store", go});
  return tessera::testing::spawn(cmd, {{"TESSERA_RDZV_TOKEN_FILE", token_file}, {"TESSERA_TEST_TIMEOUT_MS", timeout_ms}},
                                 [](const std::string& name) { return name == "TESSERA_RDZV_TOKEN"; });
}

int finish(Child& c, int ms) {
  const int st = c.wait_exit(ms);
  if (st == -1) ::kill(-c.pid, SIGKILL), c.wait_exit(10000);
  return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

}  // namespace

// RFC 2202's HMAC-SHA1 test cases 1, 2 and 6 (a key longer than the block).
TEST(StoreToken, HmacSha1MatchesRfc2202) {
  using tessera::distributed::hmac_sha1;
  EXPECT_EQ(hex(hmac_sha1(std::string(20, '\x0b'), "Hi There")), "b617318655057264e28bc0b6fb378c8ef146be00");
  EXPECT_EQ(hex(hmac_sha1("Jefe", "what do ya want for nothing?")), "effcdf6ae5eb2fa2d27416d5f184df9c259a7c79");
  EXPECT_EQ(hex(hmac_sha1(std::string(80, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")),
            "aa4ae5e15272d00e95705637ce8a3b55ed402112");
}

TEST(StoreToken, TokenComesFromOneVariableAndBadOnesAreNamed) {
  using tessera::distributed::rendezvous_token;
  const std::string dir = tessera::testing::temp_dir("tessera-token");
  tessera::testing::write_bytes(dir + "/token", "  s3cret\n");
  tessera::testing::write_bytes(dir + "/empty", "\n\n");
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", nullptr), v("TESSERA_RDZV_TOKEN", nullptr);
    EXPECT_FALSE(rendezvous_token().has_value());
  }
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", (dir + "/token").c_str()), v("TESSERA_RDZV_TOKEN", nullptr);
    EXPECT_EQ(rendezvous_token().value_or(""), "s3cret");  // surrounding whitespace dropped
  }
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", nullptr), v("TESSERA_RDZV_TOKEN", "abc");
    EXPECT_EQ(rendezvous_token().value_or(""), "abc");
  }
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", (dir + "/token").c_str()), v("TESSERA_RDZV_TOKEN", "abc");
    const std::string e = tessera::testing::error_of([] { rendezvous_token(); });
    EXPECT_CONTAINS(e, "both TESSERA_RDZV_TOKEN_FILE and TESSERA_RDZV_TOKEN are set");
  }
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", (dir + "/missing").c_str()), v("TESSERA_RDZV_TOKEN", nullptr);
    const std::string e = tessera::testing::error_of([] { rendezvous_token(); });
    EXPECT_CONTAINS(e, "TESSERA_RDZV_TOKEN_FILE: cannot read '" + dir + "/missing'");
  }
  {
    ScopedEnv f("TESSERA_RDZV_TOKEN_FILE", (dir + "/empty").c_str()), v("TESSERA_RDZV_TOKEN", nullptr);
    const std::string e = tessera::testing::error_of([] { rendezvous_token(); });
    EXPECT_CONTAINS(e, dir + "/empty' holds no token");
  }
}

// Rank 0's store (no --max-restarts) and the launchers' store (with it): the two nodes meet
// through the gate; a plain c10d client, here and through another interface, is refused and
// named in node 0's output; a relay with the wrong token is refused and says why; one with
// the right token reads the job's keys.
TEST(StoreToken, TwoNodesMeetThroughTheGateAndClientsWithoutTheTokenAreRefused) {
  using tessera::distributed::StoreRelay;
  const std::string outside = outside_address();
  for (const bool restarts : {false, true}) {
    const std::string what = restarts ? "the launchers' store" : "rank 0's store";
    const int port = tessera::testing::free_port();
    const std::string dir = tessera::testing::temp_dir("tessera-token-job");
    const std::string token = dir + "/token", go = dir + "/go";
    tessera::testing::write_bytes(token, "the job's secret\n");
    Child n0 = start_node(0, port, token, go, restarts);
    Child n1 = start_node(1, port, token, go, restarts);
    ASSERT_GT(n0.pid, 0);
    ASSERT_GT(n1.pid, 0);
    const bool ready = n0.wait_for("store ready rank 0", 60000) && n1.wait_for("store ready rank 1", 30000);
    EXPECT_TRUE(ready) << what << "\n" << n0.text << "\n" << n1.text;
    if (ready) {
      const std::string here = outside_client("127.0.0.1", port);
      EXPECT_EQ(here.rfind("refused", 0), 0u) << what << ": a c10d client without the token " << here;
      if (!outside.empty()) {
        const std::string there = outside_client(outside, port);
        EXPECT_EQ(there.rfind("refused", 0), 0u) << what << ": a c10d client at " << outside << " " << there;
      }
      {
        StoreRelay wrong("127.0.0.1", port, "not the job's secret", std::chrono::milliseconds(5000));
        const std::string got = outside_client("127.0.0.1", wrong.port());
        EXPECT_EQ(got.rfind("refused", 0), 0u) << what << ": through a relay with the wrong token " << got;
        EXPECT_CONTAINS(wrong.last_error(), "holds a different rendezvous token than this process");
      }
      {
        StoreRelay right("127.0.0.1", port, "the job's secret", std::chrono::milliseconds(5000));
        const std::string got = outside_client("127.0.0.1", right.port());
        EXPECT_EQ(got.rfind("read ", 0), 0u) << what << ": through a relay with the token " << got << "\n"
                                             << right.last_error();
        EXPECT_EQ(right.last_error(), "");
      }
    }
    tessera::testing::write_bytes(go, "1");
    EXPECT_EQ(finish(n0, 60000), 0) << what << "\n" << n0.text;
    EXPECT_EQ(finish(n1, 60000), 0) << what << "\n" << n1.text;
    if (ready) {
      EXPECT_CONTAINS(n0.text, "refused 127.0.0.1:");
      EXPECT_CONTAINS(n0.text, "it does not present the rendezvous token");
      EXPECT_CONTAINS(n0.text, "wrong rendezvous token");
    }
  }
}

// A node started with another token: its rank (or, with --max-restarts, its launcher) is
// refused as soon as it reaches node 0, in one line that names the cause, and the job fails
// instead of meeting.
TEST(StoreToken, ANodeWithAnotherTokenIsRefusedNamingTheToken) {
  for (const bool restarts : {false, true}) {
    const std::string what = restarts ? "the launchers' store" : "rank 0's store";
    const int port = tessera::testing::free_port();
    const std::string dir = tessera::testing::temp_dir("tessera-token-mismatch");
    tessera::testing::write_bytes(dir + "/a", "token A");
    tessera::testing::write_bytes(dir + "/b", "token B");
    // Node 1 would wait up to 60 s for node 0's gate (a torch 2.x rank takes seconds to start);
    // node 0 waits 10 s for a node 1 that never joins.
    const auto t0 = std::chrono::steady_clock::now();
    Child n0 = start_node(0, port, dir + "/a", dir + "/go", restarts, "10000");
    Child n1 = start_node(1, port, dir + "/b", dir + "/go", restarts, "60000");
    ASSERT_GT(n0.pid, 0);
    ASSERT_GT(n1.pid, 0);
    const int rc1 = finish(n1, 90000);
    const auto node1_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const int rc0 = finish(n0, 90000);
    EXPECT_NE(rc1, 0) << what << "\n" << n1.text;
    EXPECT_NE(rc0, 0) << what << "\n" << n0.text;
    EXPECT_CONTAINS(n1.text, "the rendezvous store at 127.0.0.1:" + std::to_string(port) +
                                 " holds a different rendezvous token than this process");
    if (!restarts) EXPECT_CONTAINS(n1.text, "rank 1 could not reach the rendezvous store: ");
    EXPECT_LT(node1_s, 45.0) << what << ": node 1 waited for its timeout instead of failing when refused\n" << n1.text;
    EXPECT_CONTAINS(n0.text, "wrong rendezvous token");
    EXPECT_EQ(n1.text.find("Exception raised from"), std::string::npos) << n1.text;
  }
}
