// Importing a torch_xla FSDP checkpoint (XlaFullyShardedDataParallel: one torch.save file
// per rank, {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
// optimizer state dict(s), other values}) as a Tessera sharded checkpoint, behind
// `tessera ckpt import-xla INPUT -o OUT` (docs/cli.md, the format in
// docs/checkpoint-format.md §7).
//
// What it writes, with W the world size at save (one data file per XLA rank):
//  - model.<fqn>: every parameter under its original name (the _fsdp_shard names, the
//    _fsdp_wrapped_module / _fpw_module levels and flat_param_<i> undone through
//    shard_metadata), un-padded and un-flattened, with FSDP's row-aligned `flat` layout
//    over the W files (each data file holds about what its XLA rank held; `chunk` for
//    shard_param_on_dim_0 models); the buffers in rank 0's file, in their original dtype
//    where buffer_info records one (torch_xla keeps them in the compute dtype);
//  - <key>.state.<fqn>.<name> for each optimizer state dict under <key> (torch.optim's,
//    keyed by parameter ids in the order of the model's parameters()): the moments cut and
//    laid out like their parameter, scalar states (step) from rank 0 under every FQN of
//    the parameter; <key>.param_groups.<g>.* as plain values, with params.<i> the FQNs;
//  - every other top-level value of rank 0 (Lightning's "step") as plain values or tensors.
// Bit for bit what torch_xla's consolidate_sharded_model_checkpoints gives for the model.
//
// Nothing runs: every file is read by Tessera's restricted unpickler. Memory: the parsed
// structure of the rank files (no tensor data) plus one piece of one tensor at a time.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/checkpoint/interop/xla_rank_file.h"

namespace tessera::checkpoint {

struct XlaImportOptions {
  // Leave out (and report) values that are not plain Python data instead of failing.
  bool skip_non_tensors = false;
};

struct XlaImportResult {
  int world_size = 0;           // XLA ranks = data files written
  std::vector<std::string> files;  // the rank files read, in rank order
  int64_t params = 0;           // model parameters (original FQNs)
  int64_t buffers = 0;          // model buffers (and other unsharded model tensors)
  int64_t optimizer_tensors = 0;
  int64_t values = 0;           // plain values
  uint64_t bytes = 0;           // tensor bytes written
  std::vector<std::pair<std::string, std::string>> skipped;  // (key, why) of values left out
};

// xla_rank_files(INPUT), the rank files an INPUT names: interop/xla_rank_file.h.

// Reads the torch_xla FSDP checkpoint INPUT names and writes the Tessera sharded checkpoint
// `out` (through a temporary sibling, committed atomically; an existing `out` is replaced
// only with `force`, and only when it is a Tessera checkpoint or an empty directory; never a
// symbolic link, nor a name ending in .safetensors). Errors name the file and the key.
XlaImportResult import_xla(const std::string& input, const std::string& out, bool force,
                           const XlaImportOptions& options = {});

}  // namespace tessera::checkpoint
