// tessera run [-n N] [--nnodes M --node-rank R --master-addr A --master-port P] -- PROGRAM ARGS...
#include <iostream>
#include <memory>

#include "commands.h"
#include "tessera/core/cli_checks.h"
#include "tessera/distributed/launch/launcher.h"

namespace tessera::cli {

std::vector<std::string>& trailing_args() {
  static std::vector<std::string> v;
  return v;
}
bool& trailing_args_given() {
  static bool given = false;
  return given;
}

Runner add_run_command(CLI::App& app) {
  auto opts = std::make_shared<distributed::LaunchOptions>();
  auto grace_s = std::make_shared<double>(5.0);
  auto deadline_s = std::make_shared<double>(0.0);
  auto rdzv_s = std::make_shared<double>(300.0);
  CLI::App* sub = app.add_subcommand(
      "run",
      "Start N local ranks of PROGRAM with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,\n"
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT). Each output line is prefixed with\n"
      "'[rank R]' (not on a terminal, a '\\r' ends a line too; a line over 64 KiB is written in pieces).\n"
      "When a rank fails, the others get SIGTERM, then SIGKILL after --grace seconds, and\n"
      "tessera run exits with that rank's code (128+signal when killed by a signal) -- or, with\n"
      "--max-restarts K, starts every rank again (up to K times; every node's launcher takes\n"
      "part), with TORCHELASTIC_RESTART_COUNT set to the restart number. A job that resumes\n"
      "itself (gpt train --resume auto) then finishes without a person.");
  sub->add_option("-n,--nproc-per-node", opts->nproc_per_node, "ranks to start on this node")
      ->default_val(1)->check(int_range(1, 4096));
  sub->add_option("--nnodes", opts->nnodes, "number of nodes (one `tessera run` per node)")
      ->default_val(1)->check(int_range(1, 65536));
  sub->add_option("--node-rank", opts->node_rank, "this node's index in [0, nnodes)")->default_val(0);
  CLI::Option* master_addr =
      sub->add_option("--master-addr", opts->master_addr,
                      "host of rank 0 (the rendezvous store); required with --nnodes > 1; with one\n"
                      "node the store listens on this address's interface only (loopback by default)")
          ->default_val("127.0.0.1");
  sub->add_option("--master-port", opts->master_port,
                  "rendezvous port; default: a free port (single node), required with --nnodes > 1")
      ->default_val(0)->check(int_range(0, 65535));
  sub->add_option("--threads-per-rank", opts->threads_per_rank,
                  "OMP_NUM_THREADS for each rank; default: 1 when ranks share the machine and\n"
                  "OMP_NUM_THREADS is not set")
      ->default_val(0)->check(int_range(0, 4096));
  sub->add_option("--grace", *grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->default_val(5.0)->check(number_range(0.0, 3600.0));
  sub->add_option("--deadline", *deadline_s, "stop every rank and exit 124 after this many seconds (0: none)")
      ->default_val(0.0)->check(number_range(0.0, 1e7));
  sub->add_option("--max-restarts", opts->max_restarts,
                  "start every rank again after a failure, up to this many times (0: exit at the\n"
                  "first failure). Node 0's launcher then hosts the rendezvous store at --master-port")
      ->default_val(0)->check(int_range(0, 1000000));
  sub->add_option("--rdzv-timeout", *rdzv_s,
                  "with --max-restarts: seconds the launchers wait for every node to join a start\n"
                  "or a restart; a node missing after it is named, and the others exit non-zero")
      ->default_val(300.0)->check(number_range(0.1, 1e6));
  sub->prefix_command();  // PROGRAM and everything after it belong to PROGRAM
  sub->footer("PROGRAM and its arguments follow the options, optionally after --.");
  return [=]() {
    opts->command = sub->remaining();
    for (const auto& a : trailing_args()) opts->command.push_back(a);
    if (opts->command.empty()) {
      std::cerr << "tessera run: no PROGRAM given (usage: tessera run -n N -- PROGRAM ARGS...)\n";
      return 2;
    }
    // Without it every node but node 0 would wait for its own 127.0.0.1 until the
    // rendezvous timeout. Given explicitly (even 127.0.0.1: nodes simulated on one
    // machine), it is taken as it is.
    if (opts->nnodes > 1 && master_addr->count() == 0) {
      std::cerr << "tessera run: --nnodes " << opts->nnodes << " needs --master-addr: the host of node 0, "
                << "reachable from every node (the default 127.0.0.1 reaches only this machine)\n";
      return 2;
    }
    opts->grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_s * 1000));
    opts->rdzv_timeout = std::chrono::milliseconds(static_cast<int64_t>(*rdzv_s * 1000));
    if (*deadline_s > 0) opts->deadline = std::chrono::milliseconds(static_cast<int64_t>(*deadline_s * 1000));
    distributed::LaunchResult r = distributed::launch(*opts);
    return r.exit_code;
  };
}

}  // namespace tessera::cli
