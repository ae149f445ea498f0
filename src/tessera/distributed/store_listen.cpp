#include "tessera/distributed/store_listen.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::distributed {
namespace {

bool is_loopback(const sockaddr* sa) {
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    return (ntohl(in->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_LOOPBACK(&in6->sin6_addr)) return true;
    // An IPv4 peer of a dual-stack socket: ::ffff:127.x.y.z.
    return IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr) && in6->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

bool same_address(const sockaddr* a, const sockaddr* b) {
  if (a->sa_family != b->sa_family) return false;
  if (a->sa_family == AF_INET)
    return reinterpret_cast<const sockaddr_in*>(a)->sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in*>(b)->sin_addr.s_addr;
  if (a->sa_family == AF_INET6)
    return std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr,
                       &reinterpret_cast<const sockaddr_in6*>(b)->sin6_addr, sizeof(in6_addr)) == 0;
  return false;
}

int port_of(const sockaddr_storage& ss) {
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port);
  return -1;
}

// This process's TCP sockets (IPv4 or IPv6) whose local port is `port`.
std::vector<int> tcp_sockets_on(int port) {
  std::vector<int> fds;
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return fds;
  const int own = ::dirfd(d);
  while (const dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    int type = 0;
    socklen_t len = sizeof type;
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
    sockaddr_storage ss{};
    len = sizeof ss;
    if (::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&ss), &len) != 0) continue;
    if ((ss.ss_family == AF_INET || ss.ss_family == AF_INET6) && port_of(ss) == port)
      fds.push_back(static_cast<int>(fd));
  }
  ::closedir(d);
  return fds;
}

bool listening(int fd) {
  int on = 0;
  socklen_t len = sizeof on;
  return ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) == 0 && on;
}

// Connections that completed the handshake but that the store has not accepted yet.
unsigned accept_queue(int listener) {
  tcp_info info{};
  socklen_t len = sizeof info;
  if (::getsockopt(listener, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return 0;
  return info.tcpi_unacked;  // a listener's current accept backlog
}

}  // namespace

std::string interface_of(const std::string& addr) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(addr.c_str(), nullptr, &hints, &res) != 0) return "";
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) {
    ::freeaddrinfo(res);
    return "";
  }
  std::string name;
  for (const addrinfo* a = res; a && name.empty(); a = a->ai_next) {
    const bool loop = is_loopback(a->ai_addr);
    for (const ifaddrs* i = ifs; i && name.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
      // Every 127.x address (and ::1) arrives on the loopback interface, which lists 127.0.0.1/8 only.
      if (loop ? (i->ifa_flags & IFF_LOOPBACK) != 0 : same_address(a->ai_addr, i->ifa_addr)) name = i->ifa_name;
    }
  }
  ::freeifaddrs(ifs);
  ::freeaddrinfo(res);
  return name;
}

std::string confine_store_listener(const std::string& addr, int port) {
  const std::string everywhere = concat("the rendezvous store on port ", port, " listens on every interface: ");
  const std::string ifname = interface_of(addr);
  if (ifname.empty())
    return concat(everywhere, "MASTER_ADDR '", addr, "' is not an address of this host");
  std::vector<int> listeners;
  for (int fd : tcp_sockets_on(port))
    if (listening(fd)) listeners.push_back(fd);
  if (listeners.empty()) return concat(everywhere, "no socket of this process listens on that port");
  for (int fd : listeners) {
    if (::setsockopt(fd, SOL_SOCKET, SO_BINDTODEVICE, ifname.c_str(), static_cast<socklen_t>(ifname.size())) != 0) {
      const int err = errno;
      return concat(everywhere, "setsockopt(SO_BINDTODEVICE, \"", ifname, "\") failed: ", std::strerror(err),
                    err == EPERM ? " (Linux before 5.7 allows it only with CAP_NET_RAW)" : "");
    }
  }
  if (interface_of("127.0.0.1") != ifname) return "";
  // Tied to loopback: no peer but a loopback address may stay. Those that came in before
  // are in the accept queue (taken by the store's thread within moments: waited for,
  // bounded) or accepted already; both are found among this process's sockets.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (int fd : listeners)
    while (accept_queue(fd) > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (int fd : tcp_sockets_on(port)) {
    if (listening(fd)) continue;
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    if (!is_loopback(reinterpret_cast<const sockaddr*>(&peer))) ::shutdown(fd, SHUT_RDWR);
  }
  return "";
}

}  // namespace tessera::distributed
