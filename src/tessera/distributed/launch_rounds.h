// The launchers' own rendezvous for restarts (launcher.cpp, `tessera run --max-restarts`):
// internal to the distributed layer.
//
// Node 0's launcher hosts a c10d TCPStore at --master-addr:--master-port; every node's
// launcher connects to it. The ranks use the same store as torchrun's "agent store"
// (TORCHELASTIC_USE_AGENT_STORE): clients only, their keys under "/worker/attempt_<n>"
// for restart round n (rendezvous.cpp), so no round sees another's keys. The launchers'
// keys are under "tessera/launch/<round>/":
//   joined       nodes that reached the round (an add)       node<i>  set by node i
//   failed       the first failure any node saw in the round (its message)
//   done         nodes whose ranks all exited 0 in the round (an add)
// A round starts when every node joined; a node that does not join within the timeout is
// named by the others, which give up. A node whose ranks fail reports it under "failed";
// the others poll it and stop their ranks instead of waiting for a collective to time out.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <optional>
#include <string>

namespace c10d {
class Store;
}

namespace tessera::distributed {

class LaunchRounds {
 public:
  // Node 0 starts the store (port 0: a free port, single node only); the others connect,
  // retrying until `timeout`. Throws tessera::Error naming the address on failure.
  LaunchRounds(const std::string& addr, int port, int nnodes, int node_rank, std::chrono::milliseconds timeout);
  ~LaunchRounds();
  LaunchRounds(const LaunchRounds&) = delete;
  LaunchRounds& operator=(const LaunchRounds&) = delete;

  int port() const { return port_; }
  // Joins round `round` and waits until every node has: "" when they all did, else what
  // went wrong (the nodes missing after the timeout, or the store gone with node 0).
  std::string join(int round);
  // The failure another node reported in `round`, if any (one store lookup; a store that
  // no longer answers is reported as such).
  std::optional<std::string> failure(int round);
  // Reports this node's failure in `round` (the first report of a round is kept).
  void report_failure(int round, const std::string& message);
  // This node's ranks all exited 0 in `round`. Node 0 then waits (bounded by the timeout)
  // until every node said so, so that the store outlives the others' last lookups.
  void finish(int round);

 private:
  std::string key(int round, const std::string& what) const;

  c10::intrusive_ptr<c10d::Store> store_;
  int port_ = 0;
  int nnodes_ = 1;
  int node_rank_ = 0;
  std::string addr_;
  std::chrono::milliseconds timeout_;
};

}  // namespace tessera::distributed
