// Who may reach a job's rendezvous store (issue 44 item 6): the store of a job on one node
// (rank 0's, or the launcher's with --max-restarts) is tied to the interface of MASTER_ADDR,
// so a client that comes through another interface of the host, as one from another
// machine would, is refused, while the job's own ranks meet through it as before.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Logging.h>

#include "tessera/config.h"
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <cstring>
#include <string>

#include "reliability/reliability_util.h"
#include "support/test_util.h"
#include "tessera/distributed/store_listen.h"

namespace {

// An address of this host on an interface other than loopback (IPv4 first), or "".
std::string outside_address() {
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return "";
  std::string v4, v6;
  for (const ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP) || (i->ifa_flags & IFF_LOOPBACK)) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) {
      ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof buf);
      v4 = buf;
    } else if (i->ifa_addr->sa_family == AF_INET6 && v6.empty()) {
      const auto* a6 = reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&a6->sin6_addr)) continue;  // needs a scope id to connect to
      ::inet_ntop(AF_INET6, &a6->sin6_addr, buf, sizeof buf);
      v6 = buf;
    }
  }
  ::freeifaddrs(ifs);
  return v4.empty() ? v6 : v4;
}

// connect() to addr:port: 0 when a connection was made, else its errno.
int connect_errno(const std::string& addr, int port) {
  sockaddr_storage ss{};
  socklen_t len = 0;
  if (addr.find(':') == std::string::npos) {
    auto* a = reinterpret_cast<sockaddr_in*>(&ss);
    a->sin_family = AF_INET;
    a->sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, addr.c_str(), &a->sin_addr);
    len = sizeof *a;
  } else {
    auto* a = reinterpret_cast<sockaddr_in6*>(&ss);
    a->sin6_family = AF_INET6;
    a->sin6_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET6, addr.c_str(), &a->sin6_addr);
    len = sizeof *a;
  }
  const int fd = ::socket(ss.ss_family, SOCK_STREAM, 0);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&ss), len);
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  return err;
}

// A c10d TCPStore client at addr:port, as anyone could start one: what it read of the
// job's keys, or "refused: <why>".
std::string outside_client(const std::string& addr, int port) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = std::chrono::milliseconds(2000);
  const int saved = FLAGS_caffe2_log_level;
  FLAGS_caffe2_log_level = 3;  // 2.x logs every refused attempt
  std::string got;
  try {
    c10d::TCPStore client(addr, so);
    got = "read " + std::to_string(client.getNumKeys()) + " keys";
  } catch (const std::exception& e) {
    got = std::string("refused: ") + std::string(e.what()).substr(0, 200);
  }
  FLAGS_caffe2_log_level = saved;
  return got;
}

}  // namespace

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
#if TESSERA_GLOO_IS_BACKEND
  // Known gap (issue 44 item 6, left open): torch 2.x's TCPStore server (libuv) still answers
  // other interfaces after confine_store_listener; measured 2026-12-07 on torch 2.15.
  GTEST_SKIP() << "torch 2.x's TCPStore server is not yet confined to MASTER_ADDR's interface (issue 44 item 6)";
#endif
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
