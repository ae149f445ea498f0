// tessera ckpt: the offline checkpoint tool (no process group needed).
//   inspect PATH | verify PATH | consolidate DIR -o FILE | reshard DIR --world-size M [--tp T] -o DIR2
//   | export PATH --format torch|safetensors -o OUT
//   | export PATH --format hf -o DIR [--max-shard-size S] [--dtype bf16|fp16|fp32] [--prefix P]
//   | import-dcp DIR -o OUT [--skip-non-tensors]
//   | import-xla DIR|GLOB|FILE -o OUT [--skip-non-tensors]
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <functional>
#include <iostream>
#include <memory>
#include <thread>
#include <vector>

#include "commands.h"
#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/offline/dcp_import.h"
#include "tessera/checkpoint/interop/hf_dir.h"
#include "tessera/checkpoint/offline/hf_export.h"
#include "tessera/checkpoint/offline/xla_import.h"
#include "tessera/checkpoint/offline/offline.h"
#include "tessera/checkpoint/reader.h"
#include "tessera/checkpoint/storage/commit.h"
#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/cli_checks.h"
#include "tessera/core/error.h"

namespace tessera::cli {

namespace {

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

namespace {

namespace ck = tessera::checkpoint;

// One subcommand of `tessera ckpt`: its parser, whether it writes an output (its
// temporary is removed on SIGINT/SIGTERM/SIGHUP), and what it does once parsed.
struct Subcommand {
  CLI::App* app;
  bool writes;
  std::function<int()> run;
};

// -o/--output and -f/--force, as every writing subcommand has them.
void add_output(CLI::App* c, std::string& out, bool& force, const char* what) {
  c->add_option("-o,--output", out, what)->required();
  c->add_flag("-f,--force", force, "replace an existing output, only one that Tessera wrote (see docs/cli.md)");
}

const char* const kSkipNonTensors =
    "leave out values that are not plain Python data (objects of other classes) instead of failing";

Subcommand add_inspect(CLI::App& ckpt) {
  auto path = std::make_shared<std::string>();
  CLI::App* c = ckpt.add_subcommand(
      "inspect", "Print the world size at save and a table of every key: kind, dtype, shape, chunks, bytes");
  c->add_option("PATH", *path, "checkpoint directory or file")->required();
  return {c, false, [path] {
            std::cout << ck::inspect(*path);
            return 0;
          }};
}

Subcommand add_verify(CLI::App& ckpt) {
  auto path = std::make_shared<std::string>();
  CLI::App* c = ckpt.add_subcommand(
      "verify", "Check completeness and every checksum; exit 0 only when intact, else 1 and the bad files/keys");
  c->add_option("PATH", *path, "checkpoint directory or file")->required();
  return {c, false, [path] {
            const std::string foreign = ck::not_a_checkpoint_reason(*path);
            if (!foreign.empty()) throw Error(foreign);  // exit 2: an input error, not corruption
            ck::VerifyReport r = ck::verify(*path);
            for (const auto& n : r.notes) std::cout << "note: " << n << "\n";
            if (r.ok) {
              std::cout << "OK: " << *path << ": " << r.chunks_checked << " chunks, " << r.bytes_checked << " bytes";
              if (r.has_checksums) std::cout << " verified\n";
              else if (r.kind == ck::kSourceHf) std::cout << " read (" << ck::kHfVerifyChecked << ")\n";
              else std::cout << " read (this file carries no checksums)\n";
              return 0;
            }
            std::cerr << "CORRUPT: " << *path << ": " << r.problems.size() + r.more_problems << " problem(s)\n";
            for (const auto& p : r.problems) std::cerr << "  " << p << "\n";
            if (r.more_problems > 0) std::cerr << "  and " << r.more_problems << " more problem(s)\n";
            return 1;
          }};
}

Subcommand add_consolidate(CLI::App& ckpt) {
  struct Args {
    std::string path, out;
    bool force = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = ckpt.add_subcommand(
      "consolidate", "Write one consolidated safetensors file (streaming; memory bounded by the largest tensor)");
  c->add_option("DIR", a->path, "checkpoint to read")->required();
  add_output(c, a->out, a->force, "safetensors file to write");
  return {c, true, [a] {
            ck::consolidate(a->path, a->out, a->force);
            std::cout << "wrote " << a->out << "\n";
            return 0;
          }};
}

Subcommand add_reshard(CLI::App& ckpt) {
  struct Args {
    std::string path, out;
    int world_size = 0, tp = 1;
    bool force = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = ckpt.add_subcommand(
      "reshard", "Rewrite a checkpoint as the sharded checkpoint a job of M ranks saves (FSDP over M/T x T-way TP)");
  c->add_option("DIR", a->path, "checkpoint to read")->required();
  c->add_option("--world-size", a->world_size, "number of ranks of the new checkpoint")
      ->required()->check(int_range(1, ck::kMaxReshardWorldSize));
  c->add_option("--tp", a->tp,
                "tensor-parallel size of the new checkpoint's mesh (default 1: FSDP alone); must divide "
                "--world-size; above 1 the checkpoint must have been saved under tensor parallelism")
      ->check(int_range(1, ck::kMaxReshardWorldSize));
  add_output(c, a->out, a->force, "directory to write");
  return {c, true, [a] {
            ck::reshard(a->path, a->world_size, a->out, a->force, a->tp);
            std::cout << "wrote " << a->out << " for " << a->world_size << " ranks";
            if (a->tp > 1) std::cout << " (dp " << a->world_size / a->tp << " x tp " << a->tp << ")";
            std::cout << "\n";
            return 0;
          }};
}

Subcommand add_export(CLI::App& ckpt) {
  struct Args {
    std::string path, out, format = "torch";
    bool force = false;
    std::string max_shard_size = "5GB", dtype, prefix;  // --format hf
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = ckpt.add_subcommand(
      "export", "Export the tensors for Python: torch (a dict torch.load reads), safetensors, or hf (a Hugging Face model directory)");
  c->add_option("PATH", a->path, "checkpoint to read")->required();
  c->add_option("--format", a->format, "torch, safetensors or hf (a Hugging Face style directory of a model's weights)")
      ->default_val("torch")->check(CLI::IsMember({"torch", "safetensors", "hf"}));
  add_output(c, a->out, a->force, "file to write (a directory for --format hf)");
  // --format hf only (checkpoint/offline/hf_export.h).
  c->add_option("--max-shard-size", a->max_shard_size,
                "hf: the most bytes per file, e.g. 5GB (the default), 500MB, 2GiB or plain bytes; "
                "a larger tensor gets a file of its own")
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              ck::parse_hf_size(s);
              return "";
            } catch (const std::exception& e) {
              return e.what();
            }
          },
          "SIZE"));
  c->add_option("--dtype", a->dtype, "hf: convert floating tensors (round to nearest even, as torch's .to()); "
                                     "default: as saved")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}));
  c->add_option("--prefix", a->prefix,
                "hf: export the tensors whose key starts with P, named without it (default: 'model.' when the "
                "checkpoint has such keys, else every tensor; '' for every tensor under its full key)");
  c->footer("--format hf writes DIR/model.safetensors, or DIR/model-0000i-of-0000N.safetensors and "
            "DIR/model.safetensors.index.json as transformers does; plain values and optimizer state are not "
            "exported.");
  return {c, true, [a, c] {
            if (a->format == "hf") {
              ck::HfExportOptions o;
              o.max_shard_size = ck::parse_hf_size(a->max_shard_size);
              if (!a->dtype.empty()) o.dtype = ck::parse_hf_dtype(a->dtype);
              if (c->count("--prefix")) o.prefix = a->prefix;
              const ck::HfExportResult r = ck::export_hf(a->path, a->out, o, a->force);
              std::cout << "wrote " << a->out << ": " << r.tensors << " tensors (prefix '" << r.prefix << "' removed), "
                        << r.total_size << " bytes in " << r.files.size() - (r.files.size() > 1) << " file(s)\n";
              return 0;
            }
            for (const char* hf_only : {"--max-shard-size", "--dtype", "--prefix"})
              if (c->count(hf_only)) throw Error(concat(hf_only, " applies to --format hf only"));
            ck::export_checkpoint(a->path, a->format == "torch" ? ck::ExportFormat::Torch : ck::ExportFormat::Safetensors,
                                  a->out, a->force);
            std::cout << "wrote " << a->out << "\n";
            return 0;
          }};
}

Subcommand add_import_dcp(CLI::App& ckpt) {  // checkpoint/offline/dcp_import.h
  struct Args {
    std::string path, out;
    bool force = false, skip_non_tensors = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = ckpt.add_subcommand(
      "import-dcp", "Import a PyTorch Distributed Checkpoint directory (torch 2.x dcp.save) as a sharded checkpoint");
  c->add_option("DIR", a->path, "DCP directory: .metadata and __<rank>_<n>.distcp files")->required();
  add_output(c, a->out, a->force, "directory to write");
  c->add_flag("--skip-non-tensors", a->skip_non_tensors, kSkipNonTensors);
  c->footer("Nothing in DIR runs: .metadata and every item are read by a restricted unpickler that refuses "
            "any global but DCP's metadata types, torch.Size, dtypes and tensor storages. Tensors keep DCP's "
            "chunks and bytes (one data file per DCP writer rank); ints, floats, bools, strings, bytes and "
            "lists/dicts of them become plain values (flattened to KEY.0, KEY.name; None is left out).");
  return {c, true, [a] {
            ck::DcpImportOptions o;
            o.skip_non_tensors = a->skip_non_tensors;
            const ck::DcpImportResult r = ck::import_dcp(a->path, a->out, a->force, o);
            for (const auto& [key, why] : r.skipped) std::cerr << "tessera: skipped '" << key << "' (" << why << ")\n";
            if (!r.ignored.empty()) {
              std::cerr << "tessera: ignored " << r.ignored.size() << " .distcp file(s) that .metadata does not use:";
              for (size_t k = 0; k < r.ignored.size() && k < 10; ++k)
                std::cerr << (k ? ", '" : " '") << r.ignored[k] << "'";
              if (r.ignored.size() > 10) std::cerr << " and " << r.ignored.size() - 10 << " more";
              std::cerr << "\n";
            }
            std::cout << "wrote " << a->out << ": " << r.tensors << " tensors in " << r.chunks << " chunks ("
                      << r.bytes << " bytes), " << r.values << " plain values, from " << r.world_size
                      << " DCP writer(s)\n";
            return 0;
          }};
}

Subcommand add_import_xla(CLI::App& ckpt) {  // checkpoint/offline/xla_import.h
  struct Args {
    std::string path, out;
    bool force = false, skip_non_tensors = false;
  };
  auto a = std::make_shared<Args>();
  CLI::App* c = ckpt.add_subcommand(
      "import-xla", "Import a torch_xla FSDP checkpoint (one file per rank) as a sharded checkpoint");
  c->add_option("INPUT", a->path,
                "a directory holding NAME_rank-XXXXXXXX-of-YYYYYYYY.pth files (one set), a quoted glob of "
                "the rank files, or one file (world size 1)")
      ->required();
  add_output(c, a->out, a->force, "directory to write");
  c->add_flag("--skip-non-tensors", a->skip_non_tensors, kSkipNonTensors);
  c->footer(
      "Each rank file is torch.save({'model': model.state_dict(), 'shard_metadata': model.get_shard_metadata(), "
      "'optimizer': optimizer.state_dict(), ...}) of an XlaFullyShardedDataParallel model (torch_xla's examples, "
      "Lightning's XLAFSDPStrategy). Writes model.<fqn> under the original names (un-padded, un-flattened), "
      "buffers in the dtype shard_metadata.buffer_info records, the optimizer state as <key>.state.<fqn>.<name> "
      "and other values as plain values; one data file per XLA rank. Nothing runs: every file is read by a "
      "restricted unpickler.");
  return {c, true, [a] {
            ck::XlaImportOptions o;
            o.skip_non_tensors = a->skip_non_tensors;
            const ck::XlaImportResult r = ck::import_xla(a->path, a->out, a->force, o);
            for (const auto& [key, why] : r.skipped) std::cerr << "tessera: skipped '" << key << "' (" << why << ")\n";
            std::cout << "wrote " << a->out << ": " << r.params << " parameters, " << r.buffers << " buffers, "
                      << r.optimizer_tensors << " optimizer tensors (" << r.bytes << " bytes), " << r.values
                      << " plain values, from " << r.world_size << " torch_xla rank file(s)\n";
            return 0;
          }};
}

}  // namespace

Runner add_ckpt_command(CLI::App& app) {
  CLI::App* ckpt = app.add_subcommand("ckpt", "Inspect, verify, consolidate, reshard and export checkpoints (offline)");
  ckpt->require_subcommand(1);
  ckpt->footer("PATH is a sharded checkpoint directory, a safetensors file, a torch.save'd .pt file or a Hugging "
               "Face model directory (model.safetensors.index.json and its shards, or model.safetensors).");
  const std::vector<Subcommand> subs = {add_inspect(*ckpt),     add_verify(*ckpt),     add_consolidate(*ckpt),
                                        add_reshard(*ckpt),     add_export(*ckpt),     add_import_dcp(*ckpt),
                                        add_import_xla(*ckpt)};
  return [subs]() -> int {
    for (const Subcommand& s : subs) {
      if (!s.app->parsed()) continue;
      if (s.writes) remove_output_on_interrupt();
      return s.run();
    }
    return 2;
  };
}

}  // namespace tessera::cli
