#include "tessera/distributed/store_gate.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/hash.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "tessera/core/env.h"
#include "tessera/core/error.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// The handshake, all fixed sizes (the relay speaks first):
//   relay -> gate: kHello, relay nonce (32)
//   gate -> relay: gate nonce (32), HMAC(token, "gate" + relay nonce + gate nonce) (20)
//   relay -> gate: HMAC(token, "relay" + relay nonce + gate nonce) (20)
//   gate -> relay: 'K' (accepted: from here on the bytes are c10d's) or 'X' (refused)
// The relay sends its proof even when the gate's failed, so that the gate can say why.
const std::string kHello = "TSRDZV1\n";
constexpr size_t kNonce = 32;
constexpr size_t kMac = 20;
constexpr auto kHandshakeTime = std::chrono::seconds(10);

std::string random_bytes(size_t n) {
  std::string s(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::getrandom(&s[got], n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    TESSERA_CHECK(r > 0, "getrandom failed: ", std::strerror(errno));
    got += static_cast<size_t>(r);
  }
  return s;
}

std::string sha1_raw(const std::string& data) {
  const std::string hex = c10::sha1(data).str();  // data is never empty here
  std::string raw(hex.size() / 2, '\0');
  for (size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return raw;
}

bool same_bytes(const std::string& a, const std::string& b) {  // in time independent of where they differ
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

int remaining_ms(Clock::time_point until) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

// Reads exactly n bytes by `until`; "" on success, else why not.
std::string read_exact(int fd, std::string& out, size_t n, Clock::time_point until) {
  out.assign(n, '\0');
  size_t got = 0;
  while (got < n) {
    pollfd p{fd, POLLIN, 0};
    const int pr = ::poll(&p, 1, remaining_ms(until));
    if (pr < 0 && errno == EINTR) continue;
    if (pr == 0) return "no answer within 10 s";
    const ssize_t r = ::recv(fd, &out[got], n - got, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r == 0) return "the connection was closed";
    if (r < 0) return std::strerror(errno);
    got += static_cast<size_t>(r);
  }
  return "";
}

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}
bool write_all(int fd, const std::string& s) { return write_all(fd, s.data(), s.size()); }

std::string peer_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr))  // an IPv4 peer of the dual-stack socket
      ::inet_ntop(AF_INET, &a->sin6_addr.s6_addr[12], host, sizeof host);
    else
      ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return concat(host, ":", port);
}

void no_delay(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
}

// Threads and sockets of a gate or a relay: an eventfd that wakes every poll at stop, the
// open connections (shut down at stop, so that a blocked send returns), and a count of
// running connection threads (detached; stop waits for it to reach zero).
struct Service {
  int wake = -1;
  std::atomic<bool> stopping{false};
  std::mutex mu;
  std::condition_variable cv;
  std::set<int> open;
  int running = 0;
  std::vector<int> listeners;
  std::thread acceptor;

  Service() {
    wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    TESSERA_CHECK(wake >= 0, "eventfd failed: ", std::strerror(errno));
  }
  ~Service() {
    for (int fd : listeners) ::close(fd);
    if (wake >= 0) ::close(wake);
  }
  bool track(int fd) {
    std::lock_guard<std::mutex> lock(mu);
    if (stopping) return false;
    open.insert(fd);
    return true;
  }
  void close_tracked(int fd) {
    std::lock_guard<std::mutex> lock(mu);
    open.erase(fd);
    ::close(fd);
  }
  void stop() {
    stopping = true;
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = ::write(wake, &one, sizeof one);
    if (acceptor.joinable()) acceptor.join();
    std::unique_lock<std::mutex> lock(mu);
    for (int fd : open) ::shutdown(fd, SHUT_RDWR);
    cv.wait(lock, [&] { return running == 0; });
  }
  // Runs `accept_one(fd)` for each accepted connection on a thread of its own.
  template <class F>
  void start_accepting(std::shared_ptr<void> owner, F accept_one) {
    acceptor = std::thread([this, owner, accept_one] {
      std::vector<pollfd> fds;
      for (int l : listeners) fds.push_back({l, POLLIN, 0});
      fds.push_back({wake, POLLIN, 0});
      while (!stopping) {
        for (auto& p : fds) p.revents = 0;
        if (::poll(fds.data(), fds.size(), -1) < 0 && errno != EINTR) break;
        for (size_t i = 0; i + 1 < fds.size(); ++i) {
          if (!(fds[i].revents & POLLIN)) continue;
          const int c = ::accept4(fds[i].fd, nullptr, nullptr, SOCK_CLOEXEC);
          if (c < 0) continue;
          no_delay(c);
          if (!track(c)) {
            ::close(c);
            continue;
          }
          {
            std::lock_guard<std::mutex> lock(mu);
            ++running;
          }
          std::thread([this, owner, accept_one, c] {
            accept_one(c);
            close_tracked(c);
            std::lock_guard<std::mutex> lock(mu);
            --running;
            cv.notify_all();
          }).detach();
        }
      }
    });
  }
  // Copies bytes both ways between a and b until either side ends or the service stops.
  void pump(int a, int b) {
    std::vector<char> buf(64 << 10);
    pollfd fds[3] = {{a, POLLIN, 0}, {b, POLLIN, 0}, {wake, POLLIN, 0}};
    while (!stopping) {
      for (auto& p : fds) p.revents = 0;
      if (::poll(fds, 3, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (fds[2].revents) return;
      for (int i = 0; i < 2; ++i) {
        if (!fds[i].revents) continue;
        const ssize_t r = ::recv(fds[i].fd, buf.data(), buf.size(), 0);
        if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (r <= 0 || !write_all(fds[1 - i].fd, buf.data(), static_cast<size_t>(r))) return;
      }
    }
  }
};

int listen_on(int family, const sockaddr* addr, socklen_t len) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  if (family == AF_INET6) {
    int off = 0;  // IPv4 too, as c10d's server does
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off);
  }
  if (::bind(fd, addr, len) != 0 || ::listen(fd, 1024) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

// A TCP connection to addr:port, or -1 with `why` set.
int connect_to(const std::string& addr, int port, std::string& why) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    why = concat("cannot resolve '", addr, "': ", ::gai_strerror(rc));
    return -1;
  }
  int fd = -1;
  for (const addrinfo* a = res; a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(res);
  if (fd >= 0) no_delay(fd);
  return fd;
}

}  // namespace

std::optional<std::string> rendezvous_token() {
  const auto file = env::get("TESSERA_RDZV_TOKEN_FILE");
  const auto value = env::get("TESSERA_RDZV_TOKEN");
  if (file && value)
    throw Error("both TESSERA_RDZV_TOKEN_FILE and TESSERA_RDZV_TOKEN are set: give the rendezvous token one way");
  std::string token;
  if (file) {
    std::ifstream in(*file, std::ios::binary);
    if (!in) throw Error(concat("TESSERA_RDZV_TOKEN_FILE: cannot read '", *file, "': ", std::strerror(errno)));
    std::ostringstream ss;
    ss << in.rdbuf();
    token = ss.str();
  } else if (value) {
    token = *value;
  } else {
    return std::nullopt;
  }
  const auto first = token.find_first_not_of(" \t\r\n");
  token = first == std::string::npos ? "" : token.substr(first, token.find_last_not_of(" \t\r\n") - first + 1);
  if (token.empty())
    throw Error(file ? concat("TESSERA_RDZV_TOKEN_FILE: '", *file, "' holds no token (it is empty)")
                     : std::string("TESSERA_RDZV_TOKEN is blank"));
  return token;
}

std::string hmac_sha1(const std::string& key, const std::string& message) {
  std::string k = key.size() > 64 ? sha1_raw(key) : key;
  k.resize(64, '\0');
  std::string inner(64, '\0'), outer(64, '\0');
  for (size_t i = 0; i < 64; ++i) {
    inner[i] = static_cast<char>(k[i] ^ 0x36);
    outer[i] = static_cast<char>(k[i] ^ 0x5c);
  }
  return sha1_raw(outer + sha1_raw(inner + message));
}

// ---- the gate

struct StoreGate::Impl {
  Service svc;
  int public_port = 0;
  int store_port = 0;
  std::string token;
  std::atomic<uint64_t> refused{0};

  void refuse(int fd, const std::string& why) {
    const uint64_t n = ++refused;
    if (n <= 20 || n % 1000 == 0)
      std::fprintf(stderr, "tessera: rendezvous store on port %d: refused %s: %s%s\n", public_port, peer_of(fd).c_str(),
                   why.c_str(), n == 20 ? " (further refusals: every 1000th is reported)" : "");
  }

  void serve(int c) {
    const auto until = Clock::now() + kHandshakeTime;
    std::string first, hello, relay_nonce, proof;
    // The first byte tells a relay from a plain c10d client (whose requests begin with a small
    // number) at once, without waiting for bytes such a client will never send.
    std::string err = read_exact(c, first, 1, until);
    if (err.empty() && first[0] == kHello[0]) err = read_exact(c, hello, kHello.size() - 1, until);
    if (!err.empty()) return refuse(c, "no handshake: " + err);
    if (first + hello != kHello)
      return refuse(c, "it does not present the rendezvous token (a plain c10d client, or a process without "
                       "TESSERA_RDZV_TOKEN/TESSERA_RDZV_TOKEN_FILE?)");
    err = read_exact(c, relay_nonce, kNonce, until);
    if (!err.empty()) return refuse(c, "handshake cut short: " + err);
    const std::string nonce = random_bytes(kNonce);
    if (!write_all(c, nonce + hmac_sha1(token, "gate" + relay_nonce + nonce))) return;
    err = read_exact(c, proof, kMac, until);
    if (!err.empty()) return refuse(c, "handshake cut short: " + err);
    if (!same_bytes(proof, hmac_sha1(token, "relay" + relay_nonce + nonce))) {
      write_all(c, "X");
      return refuse(c, "wrong rendezvous token");
    }
    std::string why;
    const int s = connect_to("127.0.0.1", store_port, why);
    if (s < 0) {
      write_all(c, "X");
      return refuse(c, concat("the store behind the gate (127.0.0.1:", store_port, ") does not answer: ", why));
    }
    if (svc.track(s)) {
      if (write_all(c, "K")) svc.pump(c, s);
      svc.close_tracked(s);
    } else {
      ::close(s);
    }
  }
};

StoreGate::StoreGate(int public_port, int store_port, std::string token) : impl_(std::make_shared<Impl>()) {
  impl_->public_port = public_port;
  impl_->store_port = store_port;
  impl_->token = std::move(token);
  sockaddr_in6 a6{};
  a6.sin6_family = AF_INET6;
  a6.sin6_addr = in6addr_any;
  a6.sin6_port = htons(static_cast<uint16_t>(public_port));
  int fd = listen_on(AF_INET6, reinterpret_cast<sockaddr*>(&a6), sizeof a6);
  if (fd < 0 && (errno == EAFNOSUPPORT || errno == EADDRNOTAVAIL)) {  // a host without IPv6
    sockaddr_in a4{};
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons(static_cast<uint16_t>(public_port));
    fd = listen_on(AF_INET, reinterpret_cast<sockaddr*>(&a4), sizeof a4);
  }
  if (fd < 0)
    throw CommError(concat("cannot listen on port ", public_port, " for the rendezvous store's token gate: ",
                           std::strerror(errno), " (is another job using it?)"));
  impl_->svc.listeners.push_back(fd);
  Impl* impl = impl_.get();
  impl_->svc.start_accepting(impl_, [impl](int c) { impl->serve(c); });
}

StoreGate::~StoreGate() { impl_->svc.stop(); }

// ---- the relay

struct StoreRelay::Impl {
  Service svc;
  std::string addr;
  int gate_port = 0;
  int port = 0;
  std::string token;
  std::chrono::milliseconds timeout{0};
  mutable std::mutex err_mu;
  std::string last_error;
  std::atomic<bool> refused{false};

  void failed(const std::string& why, bool definitive = false) {
    std::lock_guard<std::mutex> lock(err_mu);
    last_error = why;
    if (definitive) refused = true;
  }

  // The gate, reached and proven, or -1 (last_error says why).
  int open_gate() {
    const std::string where = concat("the rendezvous store at ", addr, ":", gate_port);
    const auto give_up = Clock::now() + timeout;
    std::string why;
    int g = -1;
    for (auto pause = std::chrono::milliseconds(20); !svc.stopping; pause = std::min(pause * 2, std::chrono::milliseconds(1000))) {
      g = connect_to(addr, gate_port, why);
      if (g >= 0 || Clock::now() + pause >= give_up) break;
      std::this_thread::sleep_for(pause);
    }
    if (g < 0) {
      failed(concat(where, " cannot be reached: ", why));
      return -1;
    }
    const auto until = Clock::now() + kHandshakeTime;
    const std::string nonce = random_bytes(kNonce);
    std::string reply, verdict;
    std::string err = write_all(g, kHello + nonce) ? read_exact(g, reply, kNonce + kMac, until) : "send failed";
    if (!err.empty()) {
      ::close(g);
      failed(concat(where, " did not answer the token handshake (", err,
                    "): does node 0 run without TESSERA_RDZV_TOKEN/TESSERA_RDZV_TOKEN_FILE?"));
      return -1;
    }
    const std::string gate_nonce = reply.substr(0, kNonce);
    const bool gate_ok = same_bytes(reply.substr(kNonce), hmac_sha1(token, "gate" + nonce + gate_nonce));
    err = write_all(g, hmac_sha1(token, "relay" + nonce + gate_nonce)) ? read_exact(g, verdict, 1, until) : "send failed";
    if (!gate_ok || verdict != "K") {
      ::close(g);
      failed(concat(where, " holds a different rendezvous token than this process (TESSERA_RDZV_TOKEN/"
                           "TESSERA_RDZV_TOKEN_FILE must be the same on every node)",
                    err.empty() || !gate_ok ? "" : concat(": ", err)),
             /*definitive=*/true);
      return -1;
    }
    return g;
  }

  void serve(int c) {
    const int g = open_gate();
    if (g < 0) return;
    if (svc.track(g)) {
      svc.pump(c, g);
      svc.close_tracked(g);
    } else {
      ::close(g);
    }
  }
};

StoreRelay::StoreRelay(const std::string& addr, int port, std::string token, std::chrono::milliseconds timeout)
    : impl_(std::make_shared<Impl>()) {
  impl_->addr = addr;
  impl_->gate_port = port;
  impl_->token = std::move(token);
  impl_->timeout = timeout;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  const int fd = listen_on(AF_INET, reinterpret_cast<sockaddr*>(&a), sizeof a);
  if (fd < 0) throw CommError(concat("cannot listen on 127.0.0.1 for the rendezvous relay: ", std::strerror(errno)));
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  impl_->port = ntohs(a.sin_port);
  impl_->svc.listeners.push_back(fd);
  Impl* impl = impl_.get();
  impl_->svc.start_accepting(impl_, [impl](int c) { impl->serve(c); });
}

StoreRelay::~StoreRelay() { impl_->svc.stop(); }

int StoreRelay::port() const { return impl_->port; }

std::string StoreRelay::last_error() const {
  std::lock_guard<std::mutex> lock(impl_->err_mu);
  return impl_->last_error;
}

bool StoreRelay::refused() const { return impl_->refused; }

c10::intrusive_ptr<c10d::Store> StoreRelay::connect(std::function<c10::intrusive_ptr<c10d::Store>()> make) {
  struct Result {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    c10::intrusive_ptr<c10d::Store> store;
    std::exception_ptr error;
  };
  auto r = std::make_shared<Result>();
  std::thread([r, make = std::move(make)] {
    c10::intrusive_ptr<c10d::Store> s;
    std::exception_ptr e;
    try {
      s = make();
    } catch (...) {
      e = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(r->mu);
    r->store = std::move(s);
    r->error = e;
    r->done = true;
    r->cv.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(r->mu);
  while (!r->cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return r->done; }))
    if (refused()) throw Error(last_error());
  if (r->error) std::rethrow_exception(r->error);
  return r->store;
}

}  // namespace tessera::distributed
