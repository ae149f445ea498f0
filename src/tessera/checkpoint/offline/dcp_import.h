// Importing a PyTorch Distributed Checkpoint (torch.distributed.checkpoint, torch 2.x,
// FileSystemWriter: DIR/.metadata + DIR/__<rank>_<i>.distcp) as a Tessera sharded
// checkpoint, behind `tessera ckpt import-dcp DIR -o OUT`.
//
// Nothing in the DCP directory runs: `.metadata` (a Python pickle of DCP's Metadata
// dataclasses) and every item of the .distcp files (torch.save archives of one tensor
// chunk or one plain value) are read by a restricted unpickler of our own that knows the
// DCP metadata types, torch.Size, torch dtypes and layouts, tensor rebuilding and plain
// containers, and refuses every other global with an error naming the file and the
// global. Tensors keep DCP's chunks (each chunk goes to the data file of the rank that
// wrote it, so the world size at save is the number of DCP writers whose files hold data;
// the files and ranks come from what .metadata uses, never from the directory's file
// names) and every byte;
// plain values (int, float, bool, str, bytes, and lists/tuples/dicts of them, flattened
// to "key.0", "key.name" like Tessera's torch.save import; None is skipped) become
// Tessera plain values. Other non-tensor values are an error naming the key, or are
// left out with `skip_non_tensors`.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessera::checkpoint {

struct DcpImportOptions {
  // Leave out (and report) non-tensor values that are not plain Python values instead
  // of failing.
  bool skip_non_tensors = false;
};

struct DcpImportResult {
  int world_size = 0;     // DCP writers whose files hold data (at least 1) = data files written
  int64_t tensors = 0;    // tensor keys
  int64_t chunks = 0;     // non-empty chunks written
  int64_t values = 0;     // plain values (after flattening)
  uint64_t bytes = 0;     // tensor bytes written
  std::vector<std::pair<std::string, std::string>> skipped;  // (key, why) of values left out
  std::vector<std::string> ignored;  // .distcp files in the directory that .metadata does not use
};

// Reads the DCP checkpoint in `dir` and writes the Tessera sharded checkpoint `out`
// (through a temporary sibling, committed atomically; an existing `out` is replaced
// only with `force`, and only when it is a Tessera checkpoint or an empty directory; never
// a symbolic link, nor a name ending in .safetensors). `.metadata` and the data files must
// be regular files in `dir` (a symbolic link only to a file inside it). Errors name the
// file and the key at fault.
DcpImportResult import_dcp(const std::string& dir, const std::string& out, bool force,
                           const DcpImportOptions& options = {});

}  // namespace tessera::checkpoint
