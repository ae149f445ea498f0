// The metadata of a checkpoint (docs/checkpoint-format.md §3): what every FQN is
// (kind, dtype, global shape), where its chunks live (file, byte range, checksums)
// and the plain values inline. The same structure describes every source the loader
// reads: a sharded directory, a consolidated or foreign safetensors file, or an
// imported torch file (chunks held in memory).
#pragma once
#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/json.h"  // parse_json_strict, which every reader of the format uses
#include "tessera/sharding/chunk.h"
#include "tessera/sharding/layout.h"
#include "tessera/state/state_dict.h"

namespace tessera::checkpoint {

// The newest version: 3, which adds the tp layout rule (tensor parallelism composed with a
// data-parallel cut) to version 2's rules (docs/checkpoint-format.md §3). Writers write 3
// only when some entry has a tp layout, else 2 (format_version_for), so 1-D checkpoints stay
// readable by older readers; readers take every version from 1.
constexpr int kFormatVersion = 3;
constexpr int kFormatVersionRules = 2;
constexpr const char* kMetadataFile = "tessera-checkpoint.json";
constexpr uint64_t kMaxMetadataBytes = 256ull << 20;
// Version 2 data files: the key of __metadata__ that records each stored piece's offsets in
// its tensor (JSON object: tensor name -> [offsets]), checked by every reader that opens the
// file: a piece's identity, not only its size (docs/checkpoint-format.md §3).
constexpr const char* kPieceOffsetsKey = "tessera.offsets";
// The largest world size a checkpoint may record (the launcher's limit on ranks).
constexpr int64_t kMaxWorldSize = 1 << 20;

struct ChunkInfo {
  sharding::Box box;
  std::string file;  // plain name inside the checkpoint directory (or the file itself)
  std::string name;  // tensor name inside that safetensors file
  uint64_t begin = 0, end = 0;  // absolute byte range in the file
  std::vector<uint32_t> crcs;   // per block; empty when the source has none
  at::Tensor memory;            // set instead of a file for in-memory sources
};

// EntryInfo::kind of a tensor saved whole and of one saved in pieces; a plain value's kind is
// its state::kind_name ("int", "float", ...). These strings are also the format's (the
// metadata's "kind" field), so they are compared against these names, never spelled out.
inline constexpr const char* kTensorKind = "tensor";
inline constexpr const char* kShardedKind = "sharded";

// CheckpointMetadata::source_kind: what open_checkpoint found at the path (also what
// `tessera ckpt inspect` prints and VerifyReport::kind holds).
inline constexpr const char* kSourceSharded = "sharded";            // a checkpoint directory
inline constexpr const char* kSourceConsolidated = "consolidated";  // Tessera's one safetensors file
inline constexpr const char* kSourceSafetensors = "safetensors";    // another writer's safetensors file
inline constexpr const char* kSourceTorch = "torch";                // a torch.save zip archive
inline constexpr const char* kSourceHf = "hf";                      // a Hugging Face model directory

struct EntryInfo {
  std::string kind;  // kTensorKind, kShardedKind or a plain value's kind
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  // Version 1 (and the single-file sources): every chunk, located. Version 2: empty; the
  // layout says where the pieces are, and a reader locates the ones it needs in their data
  // files' headers (ChunkReader::chunks).
  std::vector<ChunkInfo> chunks;
  std::optional<sharding::Layout> layout;
  state::Value value;  // plain values only
  bool is_tensor() const { return kind == kTensorKind || kind == kShardedKind; }
};

struct CheckpointMetadata {
  std::string source_kind;  // kSourceSharded, kSourceConsolidated, kSourceSafetensors, kSourceTorch or kSourceHf
  std::string location;     // directory or file path
  int version = kFormatVersion;  // written: 1, or what the layouts need (format_version_for)
  int world_size = 1;
  uint64_t crc_block = 0;
  std::string save_id;  // version 2: 16 hex digits, also in every data file's header
  std::vector<std::pair<std::string, uint64_t>> files;  // version 1: data files and sizes
  std::vector<std::string> keys;                          // order at save
  std::map<std::string, EntryInfo> entries;
};

// The version to write for metadata `m`: 3 when some entry has a tp layout, else 2.
int format_version_for(const CheckpointMetadata& m);

// JSON text of a plain value (int/float/bool/string/bytes/empty dict).
std::string encode_value(const state::Value& v);
// The inverse; errors name `what`.
state::Value decode_value(const std::string& json_text, const std::string& what);

// Serializes metadata of a sharded checkpoint in format m.version (2 or 3: compact,
// layouts, the version format_version_for(m); 1: indented, every chunk), with "metadata_crc32c": the CRC32C of the text with those 8
// hex digits read as "00000000". Throws when the text would exceed kMaxMetadataBytes,
// the bound every reader enforces: a writer never commits what a reader refuses.
std::string to_json(const CheckpointMetadata& m);
// Checks the "metadata_crc32c" of metadata text as written by to_json (every byte is
// covered; version 2 has it at the very end, version 1 on its own line); throws
// tessera::Error naming `where` when it is missing or does not match.
void check_metadata_checksum(const std::string& text, const std::string& where);
// The JSON text of one entry as format 2 writes it (kind, dtype, shape, layout or value).
std::string entry_json(const EntryInfo& e);
// A fresh random save id (16 lowercase hex digits).
std::string new_save_id();
// Parses and validates (version, kinds, dtypes, plain file names, chunk boxes inside
// the shape and tiling it, byte ranges matching sizes). `dir` is recorded as location.
CheckpointMetadata parse_metadata(const std::string& text, const std::string& dir);

// Validates that a file name from metadata is a plain name inside the directory.
void check_plain_name(const std::string& name, const std::string& what);
// Validates that the non-empty chunks of an entry tile its shape exactly.
void check_tiling(const std::string& fqn, const EntryInfo& e);

// Version 2: the name under which piece `i` of entry `fqn` is stored in its data file
// (FQN, or FQN@k when the file holds several pieces of the entry: list layouts only).
std::string piece_name(const std::string& fqn, const sharding::Layout& layout, const std::vector<int64_t>& shape,
                       int64_t i);

}  // namespace tessera::checkpoint
