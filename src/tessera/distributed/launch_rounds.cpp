#include "tessera/distributed/launch_rounds.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <thread>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/distributed/rendezvous.h"  // find_free_port, short_error

namespace tessera::distributed {
namespace {

using Clock = std::chrono::steady_clock;

std::string as_string(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> as_bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

// libtorch 2.x logs every failed connection attempt with a backtrace; failures are
// reported here in one line instead.
struct QuietC10Log {
  int saved = FLAGS_caffe2_log_level;
  QuietC10Log() { FLAGS_caffe2_log_level = std::max(saved, 3); }
  ~QuietC10Log() { FLAGS_caffe2_log_level = saved; }
};

// A list of node indices, "1, 4 and 7" (at most 16 named).
std::string node_list(const std::vector<int>& nodes) {
  std::string s;
  const size_t shown = std::min<size_t>(nodes.size(), 16);
  for (size_t i = 0; i < shown; ++i) {
    if (i) s += i + 1 == nodes.size() ? " and " : ", ";
    s += std::to_string(nodes[i]);
  }
  if (shown < nodes.size()) s += concat(" and ", nodes.size() - shown, " more");
  return s;
}

}  // namespace

LaunchRounds::LaunchRounds(const std::string& addr, int port, int nnodes, int node_rank,
                           std::chrono::milliseconds timeout)
    : port_(port), nnodes_(nnodes), node_rank_(node_rank), addr_(addr), timeout_(timeout) {
  if (port_ == 0) {
    TESSERA_CHECK(nnodes == 1, "launch: --master-port is required with --nnodes ", nnodes);
    port_ = find_free_port();
  }
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port_);
  so.isServer = node_rank == 0;
  so.waitWorkers = false;
  so.timeout = timeout;
  QuietC10Log quiet;
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(so.isServer ? std::string("0.0.0.0") : addr, so);
  } catch (const std::exception& e) {
    if (so.isServer)
      throw Error(concat("tessera run: node 0 cannot start the launchers' store on port ", port_,
                         " (--master-port; is another job using it?): ", short_error(e)));
    throw Error(concat("tessera run: node ", node_rank, " cannot reach node 0's launcher at ", addr, ":", port_,
                       " (--master-addr:--master-port) within ", timeout.count() / 1000.0, " s: ", short_error(e)));
  }
}

LaunchRounds::~LaunchRounds() = default;

std::string LaunchRounds::key(int round, const std::string& what) const {
  return concat("tessera/launch/", round, "/", what);
}

std::string LaunchRounds::join(int round) {
  const auto gone = [&](const std::exception& e) {
    return concat("the launchers' store at ", addr_, ":", port_, " no longer answers (node 0's launcher is gone?): ",
                  short_error(e));
  };
  int64_t joined = 0;
  try {
    store_->set(key(round, concat("node", node_rank_)), as_bytes("1"));
    joined = store_->add(key(round, "joined"), 1);
  } catch (const std::exception& e) {
    return gone(e);
  }
  const auto until = Clock::now() + timeout_;
  while (joined < nnodes_) {
    if (Clock::now() >= until) {
      std::vector<int> missing;
      try {
        for (int n = 0; n < nnodes_; ++n)
          if (!store_->check({key(round, concat("node", n))})) missing.push_back(n);
      } catch (const std::exception& e) {
        return gone(e);
      }
      return concat(missing.size() == 1 ? "node " : "nodes ", node_list(missing), " did not join ",
                    round == 0 ? std::string("the job") : concat("restart round ", round), " within ",
                    timeout_.count() / 1000.0, " s (--rdzv-timeout): ", joined, " of ", nnodes_, " nodes joined");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    try {
      joined = store_->add(key(round, "joined"), 0);
    } catch (const std::exception& e) {
      return gone(e);
    }
  }
  return "";
}

std::optional<std::string> LaunchRounds::failure(int round) {
  if (nnodes_ == 1) return std::nullopt;
  try {
    const std::string k = key(round, "failed");
    if (!store_->check({k})) return std::nullopt;
    return as_string(store_->get(k));
  } catch (const std::exception& e) {
    return concat("the launchers' store at ", addr_, ":", port_, " no longer answers (node 0's launcher is gone?)");
  }
}

void LaunchRounds::report_failure(int round, const std::string& message) {
  if (nnodes_ == 1) return;
  try {
    // compareSet keeps the first report: "" expected means "set only if absent".
    store_->compareSet(key(round, "failed"), {}, as_bytes(concat("node ", node_rank_, ": ", message)));
  } catch (const std::exception&) {
    // The store is gone with node 0: the others learn of the failure from their ranks.
  }
}

void LaunchRounds::finish(int round) {
  if (nnodes_ == 1) return;
  try {
    int64_t done = store_->add(key(round, "done"), 1);
    if (node_rank_ != 0) return;
    const auto until = Clock::now() + timeout_;
    while (done < nnodes_ && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      done = store_->add(key(round, "done"), 0);
    }
  } catch (const std::exception&) {
  }
}

}  // namespace tessera::distributed
