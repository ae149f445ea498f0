// Hugging Face model directories as input (issue 36): what transformers' save_pretrained,
// huggingface_hub's save_torch_state_dict and torch DCP's HuggingFaceStorageWriter write,
//   DIR/model.safetensors                                      (one file, no index)
//   DIR/model-00001-of-0000N.safetensors ... + DIR/model.safetensors.index.json
// with the index {"metadata": {"total_size": B}, "weight_map": {tensor: file}}, read as one
// more kind of checkpoint ("hf"): every tensor is one whole chunk of its shard file, so
// loads at any world size (FSDP ranks read only their rows), inspect, verify and
// consolidate work as for a foreign safetensors file. The reverse of hf_export.h.
//
// The weight map is checked against the shards before anything is read: a file name that
// is not a plain name inside DIR, a shard that is missing (or a symbolic link that leads
// out of DIR, or no regular file), a mapped tensor its shard does not hold, a tensor held
// by two shards ("duplicated") and a tensor of a shard the map does not name ("unmapped")
// are each an error naming the tensor and the file(s). A shard of the series the map names
// (model-<i>-of-<n>.safetensors, same model and n) is read even when the map names none of
// its tensors (they are unmapped); other files (config.json, tokenizer files, a sharded/
// subdirectory, a consolidated.safetensors beside the shards) are not read. `total_size` is
// informational, as for Hugging Face's own readers: a value that differs from the tensors'
// bytes is reported (HfDirectory::notes: inspect and verify print it), not refused. The
// Python reader (python/tessera_ckpt/_interop_hf_dir.py) makes the same checks with the same words.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

constexpr const char* kHfIndexFile = "model.safetensors.index.json";
constexpr const char* kHfSingleFile = "model.safetensors";
// The largest index read, the bound of a safetensors header (kMaxHeaderBytes): both
// describe tensors by name, and a weight map of a million tensors is under 100 MB.
constexpr uint64_t kMaxHfIndexBytes = 100ull << 20;
// What `verify` checks in a Hugging Face directory whose files carry no checksums
// (`tessera ckpt verify` and `python -m tessera_ckpt verify` print it).
constexpr const char* kHfVerifyChecked =
    "a Hugging Face directory carries no checksums: checked the weight map against the shards (every tensor "
    "in the one shard the map names), every shard's header and size, and read every byte";

// Whether `dir` is a directory without Tessera's metadata file that holds
// model.safetensors.index.json or model.safetensors (whatever they turn out to be).
bool is_hf_directory(const std::string& dir);

struct HfDirectory {
  // source_kind "hf", location the directory, files the shards (name, size) in name
  // order, keys in that order and, within a shard, in data order.
  CheckpointMetadata meta;
  bool has_index = false;
  std::optional<uint64_t> total_size;  // the index's metadata.total_size
  uint64_t tensor_bytes = 0;           // what the tensors hold
  std::vector<std::string> notes;      // remarks that are no error (total_size)
  std::map<std::string, std::string> file_of;  // tensor -> its shard (empty tensors too)
};

// A directory whose weight map and shards disagree: what() joins the problems with "; "
// (at most 20 spelled out), `problems` lists each (verify reports them one by one).
class HfDirectoryError : public Error {
 public:
  HfDirectoryError(const std::string& what, std::vector<std::string> problems)
      : Error(what), problems(std::move(problems)) {}
  std::vector<std::string> problems;
};

// Reads and checks the index (or the single model.safetensors) and every shard header it
// names. A malformed index is a tessera::Error naming it; the weight map against the
// shards, an HfDirectoryError listing every problem found, each naming the tensor and the
// file.
HfDirectory read_hf_directory(const std::string& dir);
// read_hf_directory(dir).meta (what open_checkpoint returns for such a directory).
CheckpointMetadata open_hf_directory(const std::string& dir);

}  // namespace tessera::checkpoint
