// gpt: a byte-level GPT trained with the Trainer (single process, DDP or FSDP with one
// unit per transformer block), and sampled from its checkpoints.
//
//   gpt train --devices 2 --strategy fsdp --max-steps 300 --out runs/gpt
//   gpt train --devices 2 --strategy fsdp --max-steps 600 --out runs/gpt --resume last
//   gpt train --devices 2 --strategy fsdp --max-steps 600 --out runs/gpt --resume auto   # a restarted job
//   gpt sample --ckpt runs/gpt/checkpoints/last.ckpt --prompt "This License" --tokens 200
//   gpt train --devices 2 --strategy fsdp --max-steps 300 --out runs/gpt2 --init-from model.safetensors
//   gpt train --devices 4 --tp 2 --strategy fsdp --max-steps 300 --out runs/gpt-2d   # FSDP 2 x TP 2
//
// Started without a launcher, `train` re-runs itself on --devices ranks; started by
// `tessera run -n N` (or torchrun/srun) it uses the launcher's ranks. --batch-size is the
// global batch (split evenly over the ranks), so runs at any world size see the same data.
//
// This file is the command line; train.cpp and sample.cpp hold the two commands, model.h
// the model, data.h the data, settings.h the checks of the settings.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <exception>
#include <iostream>
#include <string>
#include <typeinfo>

#include "sample.h"
#include "settings.h"
#include "tessera/core/blas.h"
#include "train.h"

// OpenBLAS kernels for this CPU, chosen before any library loads (tessera/core/blas.h).
TESSERA_TUNE_BLAS_AT_STARTUP();

namespace {

// "gpt: error: WHAT\n" in one write(2). std::cerr is unbuffered: `cerr << a << b` writes
// each piece on its own, and a rank stopped by the launcher's SIGTERM between them (after
// another rank died) left "gpt: error: " and nothing more.
void print_error(const std::string& what) {
  const std::string line = "gpt: error: " + what + "\n";
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n > 0) done += static_cast<size_t>(n);
    else if (n < 0 && errno == EINTR) continue;
    else break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpt: a byte-level GPT trained with Tessera (single, DDP or FSDP) and sampled from its checkpoints",
               "gpt"};
  app.require_subcommand(1);
  const std::string exit_status = "Exit status: 0 done, 1 error (one 'gpt: error: ...' line), 2 usage error (an unknown "
                                  "flag, a value out of range: the flag is named).";
  app.footer(exit_status);
  gpt::TrainArgs ta;
  auto* train = app.add_subcommand("train", "train on text files (default: the license texts of Debian's base-files)");
  train->add_option("--devices", ta.devices, "processes on this machine (default 1, or the launcher's)")
      ->check(gpt::int_in(1));
  train->add_option("--strategy", ta.strategy, "single|ddp|fsdp")->check(CLI::IsMember({"single", "ddp", "fsdp"}))
      ->capture_default_str();
  train->add_option("--tp", ta.tp,
                    "tensor-parallel size: ranks per tensor-parallel group, inside a node (data-parallel size = "
                    "ranks / N; --tp N alone on N ranks is pure tensor parallelism)")
      ->check(gpt::int_in(1))
      ->capture_default_str();
  train->add_flag("!--no-sequence-parallel", ta.sequence_parallel,
                  "with --tp: keep the whole sequence on every rank of a group (default: sequence parallelism, "
                  "each rank holds seq-len / tp positions of the residual stream)");
  train->add_option("--sharding", ta.sharding, "FSDP sharding: full|grad-op|none|hybrid")
      ->check(CLI::IsMember({"full", "grad-op", "none", "hybrid"}))->capture_default_str();
  train->add_option("--accelerator", ta.accelerator, "cpu|cuda|auto (auto: cuda:LOCAL_RANK when GPUs are visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  train->add_option("--peak-tflops", ta.peak_tflops, "GPU bf16 dense peak for the MFU figure (default: known GPUs)")
      ->check(gpt::positive_float());
  train->add_option("--precision", ta.precision, "32|bf16-mixed")->check(CLI::IsMember({"32", "bf16-mixed"}))
      ->capture_default_str();
  train->add_option("--max-steps", ta.max_steps, "optimizer steps to train to (counted from step 0; at least 1)")
      ->check(gpt::int_in(1))->capture_default_str();
  train->add_option("--batch-size", ta.batch_size, "global batch in sequences (split over the ranks)")
      ->check(gpt::int_in(1))->capture_default_str();
  train->add_option("--seq-len", ta.seq_len, "context length in bytes")->check(gpt::shape_flag("seq_len"))->capture_default_str();
  train->add_option("--n-layer", ta.n_layer, "transformer blocks")->check(gpt::shape_flag("n_layer"))->capture_default_str();
  train->add_option("--n-head", ta.n_head, "attention heads")->check(gpt::shape_flag("n_head"))->capture_default_str();
  train->add_option("--d-model", ta.d_model, "model width")->check(gpt::shape_flag("d_model"))->capture_default_str();
  train->add_option("--lr", ta.lr, "peak learning rate (AdamW; linear warmup, cosine decay)")
      ->check(gpt::positive_float())->capture_default_str();
  train->add_option("--warmup-steps", ta.warmup_steps, "learning-rate warmup steps (default min(30, max-steps/10))")
      ->check(gpt::int_in(0));
  train->add_option("--lr-decay-steps", ta.decay_steps,
                    "steps of the cosine schedule (default --max-steps; set it when stopping early to resume later)")
      ->check(gpt::int_in(0));
  train->add_option("--seed", ta.seed, "initial weights and data order")->capture_default_str();
  train->add_option("--data", ta.data, "text file(s) to train on (repeatable)")->check(CLI::ExistingFile);
  train->add_option("--val-fraction", ta.val_fraction, "held-out share of the bytes (the end of the text)")
      ->check(gpt::float_in(0, 0.9))->capture_default_str();
  train->add_option("--val-every", ta.val_every, "validate every K steps (0: only at the end; see --limit-val-batches)")
      ->check(gpt::int_in(0))->capture_default_str();
  train->add_option("--limit-val-batches", ta.limit_val_batches,
                    "at most N batches per validation, the final one included (default: the whole held-out split; "
                    "0: no validation at all, val_loss=nan)")
      ->check(gpt::int_in(0));
  train->add_option("--log-every", ta.log_every, "write a metrics row every K steps")->check(gpt::int_in(1))
      ->capture_default_str();
  train->add_option("--out", ta.out, "run directory: metrics.csv, hparams.yaml, checkpoints/, run.lock (one run at a time); "
                    "one that holds an earlier run is refused unless --resume or --overwrite is given")
      ->capture_default_str();
  train->add_flag("--overwrite", ta.overwrite,
                  "start a new run in an --out that holds an earlier one: its checkpoints/last.ckpt, metrics.csv and "
                  "hparams.yaml are replaced as the new run writes them (not with --resume)");
  train->add_option("--ckpt-every", ta.ckpt_every, "save checkpoints/last.ckpt every K steps (0: after each validation, see --val-every, and at "
                    "the end)")
      ->check(gpt::int_in(0))->capture_default_str();
  train->add_option("--adamw", ta.adamw,
                    "AdamW implementation: one-pass (tessera::optim::AdamW, each parameter updated in one pass "
                    "over its memory) or libtorch (torch::optim::AdamW); the same optimizer state either way")
      ->check(CLI::IsMember({"one-pass", "libtorch"}))->capture_default_str();
  train->add_option("--comm-timeout", ta.comm_timeout,
                    "seconds a collective (or the rendezvous) waits for the other ranks; a rank that times out exits "
                    "naming the collective and the ranks that had not arrived")
      ->check(gpt::positive_float())->capture_default_str();
  train->add_flag("--async-ckpt", ta.async_ckpt, "write checkpoints in the background while training goes on (one in flight)");
  train->add_option("--state-dict", ta.state_dict, "checkpoint kind: sharded|full (default: sharded for fsdp)")
      ->check(CLI::IsMember({"sharded", "full"}));
  train->add_option("--resume", ta.resume, "'last' (OUT/checkpoints/last.ckpt), 'auto' (the newest checkpoint in "
                    "OUT/checkpoints that verifies, skipping a torn or corrupted one with a message; none: start fresh, "
                    "keeping an earlier OUT/metrics.csv as OUT/metrics.earlier-<UTC time>.csv; so a restarted job "
                    "reruns the same command line) or a checkpoint path; model-shape flags left out "
                    "take the checkpoint's values, ones given must match it");
  train->add_option("--init-from", ta.init_from,
                    "start at step 0 from the model weights of a checkpoint (a sharded directory, a consolidated, "
                    "safetensors or torch.save file, or a Hugging Face model directory: model.safetensors.index.json "
                    "and its shards, or model.safetensors; keys model.<fqn> or <fqn>); fresh optimizer; not with "
                    "--resume");
  train->add_flag("--tie-weights", ta.tie_weights, "share the token embedding with the output head");
  train->add_option("--grad-clip", ta.grad_clip, "global gradient-norm clipping (0: off)")
      ->check(gpt::non_negative_float())->capture_default_str();
  train->add_option("--threads", ta.threads, "intra-op threads per rank (default: cores / ranks)")
      ->check(gpt::int_in(0));
  train->add_flag("!--no-progress-bar", ta.progress_bar, "no progress bar");
  train->footer(exit_status);

  gpt::SampleArgs sa;
  auto* sample = app.add_subcommand("sample", "print a continuation of --prompt from a checkpoint");
  sample->add_option("--ckpt", sa.ckpt, "a sharded checkpoint directory or a consolidated file")->required();
  sample->add_option("--prompt", sa.prompt, "text to continue")->capture_default_str();
  sample->add_option("--tokens", sa.tokens, "bytes to generate")->check(gpt::int_in(0))->capture_default_str();
  sample->add_option("--temperature", sa.temperature, "softmax temperature (0: greedy)")
      ->check(gpt::non_negative_float())->capture_default_str();
  sample->add_option("--top-k", sa.top_k, "sample among the k most likely bytes (0: all)")
      ->check(gpt::int_in(0, 256))->capture_default_str();
  sample->add_option("--seed", sa.seed, "sampling seed")->capture_default_str();
  sample->footer(exit_status);

  if (argc > 1 && argv[1][0] != '-' && std::string(argv[1]) != "train" && std::string(argv[1]) != "sample") {
    std::cerr << "gpt: unknown command '" << argv[1] << "' (commands: train, sample; see gpt --help)" << std::endl;
    return 2;
  }
  try {
    app.parse(argc, argv);
    if (train->parsed()) {
      for (const auto& s : gpt::shape_settings())
        if (train->count(s.flag) > 0) ta.given.insert(s.key);
      if (train->count("--tie-weights") > 0) ta.given.insert("tie_weights");
      return gpt::run_train(ta);
    }
    return gpt::run_sample(sa);
  } catch (const CLI::ParseError& e) {
    // --help prints and exits 0; a flag's error is a usage error: exit 2 (CLI11's own
    // codes, 105 for a value out of range and so on, say nothing more).
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const std::exception& e) {
    print_error(*e.what() ? std::string(e.what())
                          : std::string("an error without a message (") + typeid(e).name() + ")");
    return 1;
  }
}
