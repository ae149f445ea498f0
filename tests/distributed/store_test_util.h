// Who reaches a rendezvous store from outside the job (test_launcher_store.cpp,
// test_store_token.cpp): an address of this host to come from, a raw connect, and a plain
// c10d TCPStore client as anyone could start one.
#pragma once
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <chrono>
#include <string>

namespace tessera::testing {

// An address of this host on an interface other than loopback (IPv4 first), or "".
inline std::string outside_address() {
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
inline int connect_errno(const std::string& addr, int port) {
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
inline std::string outside_client(const std::string& addr, int port) {
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

}  // namespace tessera::testing
