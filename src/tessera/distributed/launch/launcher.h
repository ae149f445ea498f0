// Starts the local ranks of a job as fresh processes (fork + exec), with the
// torchrun environment, and watches them: output is prefixed per rank, SIGINT and
// SIGTERM are forwarded, and the first rank to fail (non-zero exit or a signal)
// brings the others down (TERM, then KILL after a grace period). With max_restarts K,
// the job is then started again, up to K times (torchrun's --max-restarts): every
// node's launcher meets the others in a new round (rounds.h) and starts its
// ranks with TORCHELASTIC_RESTART_COUNT set to the round. Used by `tessera run`, by
// Fabric's self-launch and by the multi-process tests.
//
// Inside (launcher.cpp): a RankGroup is one generation of ranks (start, poll, signal,
// close, as torch elastic's PContext), supervise() watches one until it ends, and
// launch() runs the rounds; output.cpp writes the ranks' output.
#pragma once
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::distributed {

struct LaunchOptions {
  std::vector<std::string> command;  // program and its arguments
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (single node only)
  // Intra-op threads per rank, exported as OMP_NUM_THREADS. 0: one thread when
  // several ranks share this machine and OMP_NUM_THREADS is not set already.
  int threads_per_rank = 0;
  std::map<std::string, std::string> env;  // extra variables for every rank
  std::chrono::milliseconds grace{std::chrono::seconds(5)};
  // Stop everything and fail (exit code 124) after this long; none by default.
  std::optional<std::chrono::milliseconds> deadline;
  // Forward SIGINT/SIGTERM/SIGHUP received by this process to the ranks (installs
  // process-wide handlers for the duration: one such launch at a time per process).
  bool forward_signals = true;
  // Receives each output line of a rank, without its end ('\n', '\r' or "\r\n"); a line
  // longer than 64 KiB arrives in pieces of 64 KiB (the launcher holds no more of a rank's
  // output than that). Default: written to this process's stdout/stderr as "[rank R] line",
  // a long line as one prefixed line written in pieces (see launcher.cpp).
  std::function<void(int rank, bool is_stderr, const std::string& line)> on_line;
  // Start every rank again after a failure, up to this many times (0: never). With
  // restarts, node 0's launcher hosts the ranks' rendezvous store (torchrun's agent
  // store: TORCHELASTIC_USE_AGENT_STORE) at master_port (a free port on one node when 0),
  // and no round starts before every node's launcher has joined it. Not after a
  // forwarded signal, the deadline, or a program that cannot be executed.
  int max_restarts = 0;
  // How long the launchers wait for every node to join a round (and node 1.. to reach
  // node 0's launcher); a node missing after it is named and the launch fails. Also how
  // long node 0's store may leave a lookup unanswered (a partition) before the other
  // nodes stop their ranks and fail, naming it. A signal ends any of these waits (exit
  // 128+signal, no round started after it).
  std::chrono::milliseconds rdzv_timeout{std::chrono::seconds(300)};
};

struct RankStatus {
  int rank = -1;        // global rank
  int pid = -1;
  int exit_code = -1;   // valid when signal == 0
  int signal = 0;       // the signal that ended it, or 0
  bool stopped_by_launcher = false;  // ended by the launcher's TERM/KILL after another failure
};

struct LaunchResult {
  // 0 when every rank exited 0; else the first failing rank's exit code, or
  // 128+signal when it died by a signal; 124 on deadline. 128+signal when this process
  // received SIGINT, SIGTERM or SIGHUP (forward_signals), whatever the ranks did.
  int exit_code = 0;
  int failed_rank = -1;
  std::string message;  // what happened, naming the rank; empty on success
  std::vector<RankStatus> ranks;  // of the last round
  int restarts = 0;                   // rounds started again after a failure
  std::vector<std::string> failures;  // what ended each restarted round, in order
  std::chrono::milliseconds elapsed{0};
};

LaunchResult launch(const LaunchOptions& options);

}  // namespace tessera::distributed
