// One rank file of a torch_xla FSDP checkpoint (offline/xla_import.h), read without its tensor
// data: the zip's records are located (zip_index.h), data.pkl is unpickled by the
// restricted unpickler (pickle_reader.h) with storages that hold no bytes, and every tensor
// becomes a TensorRef (its record's file offset, dtype, shape, strides), read later one
// piece at a time. Beneath the import (offline/xla_import.h), which is its one user.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tessera/state/state_dict.h"

namespace tessera::checkpoint::xla {

// A tensor of a rank file, located, not read.
struct TensorRef {
  uint64_t data = 0;           // file offset of element 0 of its storage
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t storage_offset = 0;  // in elements
  bool contiguous = true;
  int64_t numel() const;
};

struct ShardInfo {
  std::vector<int64_t> orig_size;
  std::string orig_name;
};
struct FlattenInfo {
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<int64_t> numels;
};

// model.get_shard_metadata().
struct ShardMetadata {
  int64_t world_size = 0, rank = -1;
  std::map<std::string, std::map<std::string, ShardInfo>> shard_info;  // FSDP module -> shard name -> info
  std::map<std::string, FlattenInfo> flatten_info;                     // "<module>.flat_param_<i>" -> info
  std::map<std::string, at::ScalarType> buffer_info;                   // buffer name -> _orig_dtype
  // The same text for the same metadata, whatever the rank (world_size included, rank not).
  std::string canonical() const;
};

// A leaf of a pickled value, under its dotted key (containers flattened: "betas.0").
struct Leaf {
  enum Kind { Tensor, Value, Foreign } kind = Value;
  std::string key;
  TensorRef tensor;    // Tensor
  state::Value value;  // Value: int, float, bool, str, bytes, or an empty dict for an empty container
  std::string what;    // Foreign: what it is ("a datetime.date object")
};

// A torch.optim state dict: {"state": {id: {name: value}}, "param_groups": [{..., "params": [ids]}]}.
struct OptimizerState {
  std::string key;                                     // its key at the top level ("optimizer", "optimizer.0")
  std::map<int64_t, std::vector<Leaf>> state;          // parameter id -> its state (keys: "exp_avg", ...)
  std::vector<std::vector<int64_t>> group_params;      // each group's parameter ids
  std::vector<std::vector<std::string>> group_names;   // each group's "param_names" (torch >= 2.6), or empty
  std::vector<Leaf> groups;                            // the rest of param_groups (keys "0.lr", "0.betas.0", ...)
};

struct RankFile {
  std::string path;
  uint64_t dev = 0, ino = 0, size = 0;  // the file read (checked again when its data is read)
  ShardMetadata meta;
  std::vector<std::pair<std::string, TensorRef>> model;  // model.state_dict(), in order
  std::vector<OptimizerState> optimizers;
  std::vector<Leaf> others;                              // every other top-level key, flattened ("step")
};

// Reads `path`. Errors name the file and the key.
RankFile read_rank_file(const std::string& path);

// "<prefix>_rank-XXXXXXXX-of-YYYYYYYY.pth": torch_xla's examples' and Lightning's names.
struct RankName {
  std::string prefix;
  int64_t rank = 0, world = 0;
};
bool parse_rank_name(const std::string& path, RankName& n);

// "'path' key 'k'" for messages.
std::string at_key(const std::string& path, const std::string& key);

}  // namespace tessera::checkpoint::xla

namespace tessera::checkpoint {

// The rank files INPUT names: a directory (its files NAME_rank-XXXXXXXX-of-YYYYYYYY.pth, one
// such set), a glob pattern (quoted, expanded here), or one file. Errors name what is
// missing: a rank file of the set, or any file at all.
std::vector<std::string> xla_rank_files(const std::string& input);

}  // namespace tessera::checkpoint
