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
//   left         nodes but node 0 that saw every node done (an add)
// A round starts when every node joined; a node that does not join within the timeout is
// named by the others, which give up. A node whose ranks fail reports it under "failed";
// the others poll it and stop their ranks instead of waiting for a collective to time out,
// and a node whose ranks had all exited 0 already starts the next round with it instead
// of leaving the failed node to wait for it. Node 0 keeps the store until every other
// node saw the round end ("left").
//
// No call here waits on the network. Every store call runs on a thread of its own (the
// store thread, which also connects nodes 1.. to node 0 first), in the order posted; the
// launcher's thread waits for an answer at most until a deadline, asking a Stop callback
// every 20 ms. So a node 0 that stops answering without closing its connections (a network
// partition: a store call would wait for an answer forever) holds up neither the
// launcher's supervision of its ranks (output, exits) nor its reaction to Ctrl-C / SIGTERM;
// it is reported once a call has waited --rdzv-timeout.
#pragma once
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace c10d {
class Store;
}

namespace tessera::distributed {

class LaunchRounds {
 public:
  // True when the launch is to stop (a signal arrived): asked every 20 ms while waiting.
  using Stop = std::function<bool()>;

  // What waiting on the other nodes came to.
  struct Outcome {
    enum Kind {
      kReady,    // every node did (joined the round, or finished it)
      kFailed,   // another node reported a failure in the round: a restart may help
      kStopped,  // Stop said so
      kError,    // nodes missing after the timeout, node 0's store gone or silent: the launch ends
    };
    Kind kind = kReady;
    std::string message;  // kFailed: the other node's report; kError: what went wrong; kReady: a note or ""
  };

  // Node 0 starts the store (port 0: a free port, single node only), throwing
  // tessera::Error naming the port when it cannot. The others connect to it on the store
  // thread (retrying until `timeout`): join(0) reports it when they cannot.
  LaunchRounds(const std::string& addr, int port, int nnodes, int node_rank, std::chrono::milliseconds timeout);
  // Waits up to 2 s for the calls still queued (a failure report); a store thread whose
  // call node 0 does not answer is left to the process's end.
  ~LaunchRounds();
  LaunchRounds(const LaunchRounds&) = delete;
  LaunchRounds& operator=(const LaunchRounds&) = delete;

  int port() const { return port_; }
  // Joins round `round` and waits until every node has: kReady; kStopped; or kError naming
  // the nodes missing after the timeout, or node 0 unreachable.
  Outcome join(int round, const Stop& stop);
  // News of `round` from the other nodes, without waiting: kFailed with the failure another
  // node reported, or kError when node 0's store is gone or has not answered a lookup for
  // the timeout. None yet: nullopt (and a lookup is started when none is under way).
  std::optional<Outcome> news(int round);
  // Reports this node's failure in `round` (the first report of a round is kept). Queued:
  // returns at once.
  void report_failure(int round, const std::string& message);
  // This node's ranks all exited 0 in `round`: waits until every node's did (kReady), another
  // node reports a failure in the round (kFailed), Stop says so, or node 0 is lost (kError).
  // After the timeout with none of these, kReady with a note. Node 0 then waits (bounded by
  // the timeout) until the others saw the round end, so that the store outlives their
  // last lookups.
  Outcome finish(int round, const Stop& stop);

 private:
  struct Answer {  // what a store call found
    int64_t number = 0;
    std::optional<std::string> text;
    std::vector<int> nodes;
  };
  using Run = std::function<void(c10d::Store&, Answer&)>;
  struct Call;
  struct Shared;

  std::string key(int round, const std::string& what) const;
  std::shared_ptr<Call> post(Run run);
  // Posts `run` and waits for its answer until `until`, asking `stop` every 20 ms. Answered
  // without an error: nullopt, the answer in `answer`. Else what to return: kStopped, or
  // kError (the store's error, or that it did not answer by `until`).
  std::optional<Outcome> ask(Run run, std::chrono::steady_clock::time_point until, const Stop& stop, Answer& answer);
  // That node 0 left a call unanswered for `waited`.
  std::string silent(std::chrono::steady_clock::duration waited) const;

  c10::intrusive_ptr<c10d::Store> store_;  // node 0: the server (the store thread has its own reference)
  std::shared_ptr<Shared> shared_;         // with the store thread (which may outlive this object)
  std::thread thread_;
  std::shared_ptr<Call> lookup_;           // news(): the lookup under way, of round lookup_round_
  int lookup_round_ = -1;
  int port_ = 0;
  int nnodes_ = 1;
  int node_rank_ = 0;
  std::string addr_;
  std::chrono::milliseconds timeout_;
};

}  // namespace tessera::distributed
