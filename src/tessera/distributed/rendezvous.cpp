#include "tessera/distributed/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cctype>
#include <cstdio>
#include <memory>
#include <mutex>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/arrivals.h"  // format_duration
#include "tessera/distributed/store_gate.h"
#include "tessera/distributed/store_listen.h"

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// The key every rank adds 1 to once it has reached the store.
const char* const kJoinedKey = "tessera/rendezvous/joined";

std::string where(const World& w) { return concat(w.master_addr, ":", w.master_port); }

// Whether the operation that failed ran out its time: by the clock, or by libtorch's
// message (its socket connect counts whole seconds, so it may give up before the clock says so).
bool ran_out(std::chrono::milliseconds waited, std::chrono::milliseconds timeout, const std::exception& e) {
  if (waited.count() * 10 >= timeout.count() * 9) return true;
  std::string m = e.what();
  for (auto& c : m) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return m.find("timed out") != std::string::npos || m.find("timeout") != std::string::npos;
}

// A rank's gate or relay serves its store until the process ends (the store handed out by
// connect_store does not say when it is let go): kept here, never destroyed.
void keep_until_exit(std::shared_ptr<void> p) {
  static std::mutex mu;
  static auto* kept = new std::vector<std::shared_ptr<void>>();
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back(std::move(p));
}

}  // namespace

std::string short_error(const std::exception& e) {
  std::string msg;
  if (const auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    msg = ce->what_without_backtrace();
  } else {
    msg = e.what();
  }
  const auto bt = msg.find("Exception raised from");
  if (bt != std::string::npos) msg.erase(bt);
  while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
  const auto nl = msg.find('\n');
  if (nl != std::string::npos) msg = msg.substr(0, nl);
  return msg;
}

c10::intrusive_ptr<c10d::Store> connect_store(const World& w, std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(w.master_port);
  so.isServer = w.rank == 0 && !w.agent_store;
  if (so.isServer) so.numWorkers = static_cast<size_t>(w.world_size);
  so.waitWorkers = false;
  so.timeout = timeout;
  // With a rendezvous token the store answers on loopback only, at a port of its own, behind
  // a gate on MASTER_PORT; every rank, rank 0's own client aside, comes through a relay in its
  // process (store_gate.h).
  const std::optional<std::string> token = rendezvous_token();
  std::string host = w.master_addr;
  std::shared_ptr<StoreRelay> relay;
  if (token) {
    host = "127.0.0.1";
    if (so.isServer) {
      so.port = static_cast<uint16_t>(find_free_port());
    } else {
      relay = std::make_shared<StoreRelay>(w.master_addr, w.master_port, *token, timeout);
      keep_until_exit(relay);
      so.port = static_cast<uint16_t>(relay->port());
    }
  }
  const auto t0 = Clock::now();
  c10::intrusive_ptr<c10d::Store> store;
  // libtorch 2.x logs each failed connection attempt (a warning per retry, an error at the
  // end) with the whole exception, backtrace included; the failure is reported below in
  // one line, so c10's log is limited to fatal messages while connecting.
  struct QuietWarnings {
    int saved = FLAGS_caffe2_log_level;
    QuietWarnings() { FLAGS_caffe2_log_level = std::max(saved, 3); }
    ~QuietWarnings() { FLAGS_caffe2_log_level = saved; }
  } quiet;
  try {
    auto make = [host, so]() -> c10::intrusive_ptr<c10d::Store> { return c10::make_intrusive<c10d::TCPStore>(host, so); };
    store = relay ? relay->connect(make) : make();
    if (so.isServer && token) {
      const std::string warning = confine_store_listener("127.0.0.1", so.port);
      if (!warning.empty())
        throw CommError(concat("rank 0 cannot keep the rendezvous store to loopback behind the rendezvous token's "
                               "gate (without that the token would protect nothing): ", warning));
      keep_until_exit(std::make_shared<StoreGate>(w.master_port, so.port, *token));
    } else if (so.isServer && w.num_nodes == 1) {
      // Every rank of a one-node job is on this host: the store is kept to the interface of
      // MASTER_ADDR (loopback by default), so that no other machine can reach it (store_listen.h).
      const std::string warning = confine_store_listener(w.master_addr, w.master_port);
      if (!warning.empty()) std::fprintf(stderr, "tessera: warning: rank 0: %s\n", warning.c_str());
    }
    // A launcher's store outlives the ranks of one round (tessera run --max-restarts,
    // torchrun): each round keeps to its own keys, under torch's name for them.
    if (w.agent_store)
      store = c10::make_intrusive<c10d::PrefixStore>(concat("/worker/attempt_", w.restart_count), store);
    store->add(kJoinedKey, 1);
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
    // Through a relay, its own account of the gate (a token mismatch, say) says more than c10d's.
    const std::string relay_error = relay ? relay->last_error() : "";
    if (!relay_error.empty())
      throw CommError(concat("rank ", w.rank, " could not reach the rendezvous store: ", relay_error));
    const bool timed_out = ran_out(waited, timeout, e);
    if (so.isServer && !timed_out) {
      throw CommError(concat("rank ", w.rank, " could not start the rendezvous store on port ", so.port,
                             so.port == w.master_port ? std::string(" (MASTER_PORT; is another job using it?)")
                                                      : concat(" (its own, behind the gate on MASTER_PORT ", w.master_port, ")"),
                             ": ", short_error(e)));
    }
    if (timed_out) {
      throw CommError(concat("rank ", w.rank, " could not reach the rendezvous store at ", where(w),
                             " (MASTER_ADDR:MASTER_PORT) within the timeout of ", format_duration(timeout),
                             ": is rank 0 running, and is that its address?"));
    }
    throw CommError(concat("rank ", w.rank, " could not reach the rendezvous store at ", where(w),
                           " (MASTER_ADDR:MASTER_PORT): ", short_error(e)));
  }
  return store;
}

void throw_join_failure(const World& w, c10d::Store& store, std::chrono::milliseconds timeout,
                        std::chrono::milliseconds waited, const std::exception& cause) {
  int64_t joined = -1;
  try {
    joined = store.add(kJoinedKey, 0);
  } catch (const std::exception&) {
    // The store is gone (its host, rank 0, failed): the count is unknown.
  }
  const std::string count =
      joined >= 0 ? concat(joined, " of ", w.world_size, " ranks joined") : std::string("the store no longer answers");
  if (ran_out(waited, timeout, cause) && (joined < 0 || joined < w.world_size)) {
    throw CommError(concat("rendezvous at ", where(w), " timed out after ", format_duration(timeout), " on rank ", w.rank,
                           ": ", count, joined >= 0 ? " (are the others started, with the same MASTER_ADDR and "
                                                      "MASTER_PORT?)"
                                                    : ""));
  }
  throw CommError(concat("creating the process group on rank ", w.rank, " of ", w.world_size, " at ", where(w),
                         " failed (", count, ", timeout ", format_duration(timeout), "): ", short_error(cause)));
}

int find_free_port() {
  // IPv6's wildcard with IPv4 mapped in (both families' conflicts checked), else IPv4's.
  int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd >= 0) {
    int off = 0;
    sockaddr_in6 a6{};
    a6.sin6_family = AF_INET6;
    a6.sin6_addr = in6addr_any;
    a6.sin6_port = 0;
    if (::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof off) == 0 &&
        ::bind(fd, reinterpret_cast<sockaddr*>(&a6), sizeof(a6)) == 0) {
      socklen_t len = sizeof(a6);
      const bool named = ::getsockname(fd, reinterpret_cast<sockaddr*>(&a6), &len) == 0;
      ::close(fd);
      if (named && a6.sin6_port != 0) return ntohs(a6.sin6_port);
    } else {
      ::close(fd);
    }
  }
  fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TESSERA_CHECK(fd >= 0, "socket() failed while looking for a free port");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    throw Error("bind() to a free port failed");
  }
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  ::close(fd);
  return port;
}

}  // namespace tessera::distributed
