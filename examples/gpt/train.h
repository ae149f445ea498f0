// The `gpt train` command: its settings (one field per flag) and the run they start.
#pragma once
#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace gpt {

struct TrainArgs {
  int devices = 0;  // 0: the launcher's LOCAL_WORLD_SIZE, else 1
  int tp = 1;       // tensor-parallel size (ranks per group, inside a node)
  bool sequence_parallel = true;  // with tp > 1
  std::string strategy = "fsdp", sharding = "full", precision = "32", state_dict, resume;
  std::string init_from;  // a checkpoint whose model weights replace the initial ones (step 0)
  std::string accelerator = "auto";
  double peak_tflops = 0;  // 0: the GPU's bf16 dense peak when known (core::peak_tflops)
  int64_t max_steps = 300, batch_size = 16, seq_len = 64, n_layer = 4, n_head = 4, d_model = 128;
  int64_t warmup_steps = -1, decay_steps = 0, ckpt_every = 0, val_every = 50, log_every = 10;
  int64_t limit_val_batches = -1;  // batches per validation; -1: all, 0: no validation
  double comm_timeout = 60;  // seconds a collective may wait for the other ranks (CommOptions::timeout)
  double lr = 2e-3, min_lr_ratio = 0.1, weight_decay = 0.01, grad_clip = 1.0, val_fraction = 0.1;
  uint64_t seed = 1234;
  std::vector<std::string> data;
  std::string out = "gpt-run";
  bool tie_weights = false, progress_bar = true, async_ckpt = false;
  bool overwrite = false;  // a new run may replace an earlier run's files in `out`
  std::string adamw = "one-pass";  // or "libtorch": torch::optim::AdamW's tensor operations
  int threads = 0;  // 0: cores / ranks on this node
  std::set<std::string> given;  // model-shaping settings given on the command line (hparams keys)
};

// Trains (re-running itself on --devices ranks when started without a launcher), then
// prints the run's summary lines. Returns the process exit code.
int run_train(TrainArgs a);

}  // namespace gpt
