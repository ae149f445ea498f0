// tessera ckpt: the offline checkpoint tool (no process group needed).
//   inspect PATH | verify PATH | consolidate DIR -o FILE | reshard DIR --world-size M -o DIR2
//   | export PATH --format torch|safetensors -o OUT
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <iostream>
#include <memory>
#include <thread>

#include "commands.h"
#include "tessera/checkpoint/offline.h"
#include "tessera/core/cli_checks.h"

namespace tessera::cli {

namespace {
struct CkptArgs {
  std::string path, out, format = "torch";
  int world_size = 0;
  bool force = false;
};

std::atomic<bool> g_interrupted{false};

const char* signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGHUP ? "SIGHUP" : "a signal";
}

// For the commands that write: SIGINT, SIGTERM and SIGHUP are blocked in every thread
// (threads started later inherit the mask) and taken by one thread that removes the
// unfinished temporary output, then ends the process by the same signal. Called before
// any other thread starts. (SIGKILL cannot be caught: the next run for the same output
// removes what a dead run left; see remove_dead_temporaries.)
void remove_output_on_interrupt() {
  static sigset_t set;
  sigemptyset(&set);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction old {};
    // An ignored signal (nohup, a background job) stays ignored.
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler != SIG_IGN) sigaddset(&set, sig);
  }
  if (sigisemptyset(&set) || ::pthread_sigmask(SIG_BLOCK, &set, nullptr) != 0) return;
  std::thread([] {
    int sig = 0;
    if (::sigwait(&set, &sig) != 0) return;
    g_interrupted = true;
    const std::string tmp = checkpoint::abandon_output_in_progress();
    std::cerr << "tessera: interrupted by " << signal_name(sig);
    if (!tmp.empty()) std::cerr << "; removed the unfinished output '" << tmp << "'";
    std::cerr << std::endl;
    std::signal(sig, SIG_DFL);
    ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
    ::raise(sig);  // ends the process with the signal's status
    ::_exit(128 + sig);
  }).detach();
}
}  // namespace

void wait_if_interrupted() {
  if (!g_interrupted) return;
  for (;;) ::pause();
}

Runner add_ckpt_command(CLI::App& app) {
  auto a = std::make_shared<CkptArgs>();
  CLI::App* sub = app.add_subcommand("ckpt", "Inspect, verify, consolidate, reshard and export checkpoints (offline)");
  sub->require_subcommand(1);
  sub->footer("PATH is a sharded checkpoint directory, a safetensors file or a torch.save'd .pt file.");

  CLI::App* inspect = sub->add_subcommand(
      "inspect", "Print the world size at save and a table of every key: kind, dtype, shape, chunks, bytes");
  inspect->add_option("PATH", a->path, "checkpoint directory or file")->required();

  CLI::App* verify = sub->add_subcommand(
      "verify", "Check completeness and every checksum; exit 0 only when intact, else 1 and the bad files/keys");
  verify->add_option("PATH", a->path, "checkpoint directory or file")->required();

  CLI::App* consolidate = sub->add_subcommand(
      "consolidate", "Write one consolidated safetensors file (streaming; memory bounded by the largest tensor)");
  consolidate->add_option("DIR", a->path, "checkpoint to read")->required();
  consolidate->add_option("-o,--output", a->out, "safetensors file to write")->required();
  consolidate->add_flag("-f,--force", a->force, "replace an existing output");

  CLI::App* reshard = sub->add_subcommand("reshard", "Rewrite a checkpoint as a sharded checkpoint for M ranks");
  reshard->add_option("DIR", a->path, "checkpoint to read")->required();
  reshard->add_option("--world-size", a->world_size, "number of ranks of the new checkpoint")
      ->required()->check(int_range(1, checkpoint::kMaxReshardWorldSize));
  reshard->add_option("-o,--output", a->out, "directory to write")->required();
  reshard->add_flag("-f,--force", a->force, "replace an existing output");

  CLI::App* exp = sub->add_subcommand(
      "export", "Export the tensors for Python: torch (a dict torch.load reads) or safetensors");
  exp->add_option("PATH", a->path, "checkpoint to read")->required();
  exp->add_option("--format", a->format, "torch or safetensors")
      ->default_val("torch")->check(CLI::IsMember({"torch", "safetensors"}));
  exp->add_option("-o,--output", a->out, "file to write")->required();
  exp->add_flag("-f,--force", a->force, "replace an existing output");

  return [=]() -> int {
    namespace ck = tessera::checkpoint;
    if (inspect->parsed()) {
      std::cout << ck::inspect(a->path);
      return 0;
    }
    if (verify->parsed()) {
      ck::VerifyReport r = ck::verify(a->path);
      if (r.ok) {
        std::cout << "OK: " << a->path << ": " << r.chunks_checked << " chunks, " << r.bytes_checked << " bytes";
        std::cout << (r.has_checksums ? " verified\n" : " read (this file carries no checksums)\n");
        return 0;
      }
      std::cerr << "CORRUPT: " << a->path << ": " << r.problems.size() << " problem(s)\n";
      for (const auto& p : r.problems) std::cerr << "  " << p << "\n";
      return 1;
    }
    if (consolidate->parsed() || reshard->parsed() || exp->parsed()) remove_output_on_interrupt();
    if (consolidate->parsed()) {
      ck::consolidate(a->path, a->out, a->force);
      std::cout << "wrote " << a->out << "\n";
      return 0;
    }
    if (reshard->parsed()) {
      ck::reshard(a->path, a->world_size, a->out, a->force);
      std::cout << "wrote " << a->out << " for " << a->world_size << " ranks\n";
      return 0;
    }
    if (exp->parsed()) {
      ck::export_checkpoint(a->path, a->format == "torch" ? ck::ExportFormat::Torch : ck::ExportFormat::Safetensors,
                            a->out, a->force);
      std::cout << "wrote " << a->out << "\n";
      return 0;
    }
    return 2;
  };
}

}  // namespace tessera::cli
