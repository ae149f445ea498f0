// `tessera ckpt export --format hf`: a model's weights as a Hugging Face style directory,
// the layout transformers' save_pretrained writes and `from_pretrained`,
// `safetensors.torch.load_file` and DCP's HuggingFaceStorageReader read:
//   OUT/model.safetensors                                   (everything fits in one file)
//   OUT/model-00001-of-0000N.safetensors ... + OUT/model.safetensors.index.json
// The index is {"metadata": {"total_size": B}, "weight_map": {name: file}} (2-space
// indent, sorted keys, as transformers writes it). Files are filled in key order and a
// new one is started when the next tensor would take the current one over the limit; a
// tensor larger than the limit goes alone into its own file (huggingface_hub's rule).
// Streams one tensor at a time (memory: the largest tensor, twice when converting), and
// publishes the directory atomically like the other offline operations (offline.h).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessera::checkpoint {

// transformers' default shard limit, "5GB".
constexpr uint64_t kDefaultHfMaxShardSize = 5'000'000'000ull;

// A size as transformers and huggingface_hub accept it: plain bytes ("123"), or a number
// (fraction allowed) with a unit, case-insensitive: KB MB GB TB (powers of 1000) or
// KiB MiB GiB TiB (powers of 1024); "B" is bytes. Throws tessera::Error naming the text.
uint64_t parse_hf_size(const std::string& text);

enum class HfDtype { AsSaved, BF16, F16, F32 };
// "bf16", "fp16" or "fp32"; throws tessera::Error naming the text otherwise.
HfDtype parse_hf_dtype(const std::string& text);

struct HfExportOptions {
  uint64_t max_shard_size = kDefaultHfMaxShardSize;
  // Floating tensors (F64, F32, F16, BF16) converted to this dtype, rounding to nearest
  // even as torch's Tensor.to() does; integer and bool tensors are written as saved.
  HfDtype dtype = HfDtype::AsSaved;
  // The tensors exported are those whose key starts with the prefix, written under the
  // key with the prefix removed. A prefix not ending in '.' gets one ("model" ==
  // "model."); "" selects every tensor under its full key. Unset: "model." (the module
  // state of Fabric, Trainer and gpt checkpoints) when any tensor key starts with it,
  // else every tensor. Plain values are never exported.
  std::optional<std::string> prefix;
};

struct HfExportResult {
  std::string prefix;               // the prefix applied
  std::vector<std::string> files;   // file names written inside the output, index last
  size_t tensors = 0;
  uint64_t total_size = 0;          // tensor bytes, as in the index
};

// Which tensors go into which file: the indices of `sizes` (tensor bytes, in key
// order) per file, in file order, by huggingface_hub's split_state_dict_into_shards rule.
std::vector<std::vector<size_t>> plan_hf_shards(const std::vector<uint64_t>& sizes, uint64_t max_shard_size);

// Reads any checkpoint Tessera reads (a sharded directory written at any world size, a
// consolidated or foreign safetensors file, a torch.save'd dict) and writes the directory
// `out`. `force`: replace an existing `out` that is empty or holds only files this export
// writes (model*.safetensors, model.safetensors.index.json); anything else at `out` is
// refused, with or without it. An output that is, lies inside or contains the source is
// refused. Errors name the flag, key or path at fault.
HfExportResult export_hf(const std::string& src, const std::string& out, const HfExportOptions& options, bool force);

}  // namespace tessera::checkpoint
