// Building blocks shared by the distributed save and the offline tools: writing one
// data file of a sharded checkpoint from a list of pieces (each produced lazily, so
// only one piece is in memory at a time), assembling and committing the metadata,
// and the __metadata__ of a consolidated file.
#pragma once
#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/metadata.h"

namespace tessera::checkpoint {

class SyncQueue;

// "data-rank00003.safetensors"
std::string data_file_name(int rank);

struct Piece {
  std::string fqn;
  at::ScalarType dtype = at::kFloat;
  sharding::Box box;                    // inside the tensor's global shape
  std::function<at::Tensor()> data;     // called once, when the piece is written
};

struct DataFileResult {
  std::string file;
  uint64_t size = 0;
  std::vector<std::pair<std::string, ChunkInfo>> chunks;  // (fqn, chunk)
};

// Writes `dir/name` (a safetensors file, fsync'ed) holding the pieces (named FQN, or FQN@k
// when several pieces of one FQN are in the file). `identity` goes into __metadata__
// (format 2: data_file_identity). With `sync`, the fsync is handed to it (the file is
// durable once sync->wait() returns).
DataFileResult write_data_file(const std::string& dir, const std::string& name, const std::vector<Piece>& pieces,
                               const std::map<std::string, std::string>& identity = {}, SyncQueue* sync = nullptr);
// The __metadata__ that ties a data file of a format-2 checkpoint to its rank and save:
// tessera.version "2", tessera.rank, tessera.save_id.
std::map<std::string, std::string> data_file_identity(int rank, const std::string& save_id);

// Format 2 for metadata assembled from written data files (offline writers that place
// pieces irregularly: DCP import): each tensor entry's chunks (in data files named by
// data_file_name) become its layout: `whole` for one full chunk, else a `list`. Throws
// (internal) if a chunk's name in its file is not the one the layout gives it.
void layouts_from_chunks(CheckpointMetadata& m);

// Writes `dir/tessera-checkpoint.json` (fsync'ed) and fsyncs `dir`: to_json(m), which
// refuses metadata a reader would refuse (kMaxMetadataBytes) before anything is written.
void write_metadata_file(const std::string& dir, const CheckpointMetadata& m);
// The same with the text already made by to_json.
void write_metadata_text(const std::string& dir, const std::string& text);

// The __metadata__ of a consolidated file for the entries of `m` (kinds, plain
// values, key order, world size).
std::map<std::string, std::string> consolidated_header(const CheckpointMetadata& m);

// The one rule for every writer (a save, consolidate, reshard, export, import-dcp,
// import-xla; `export --format hf` is stricter, hf_export.cpp): an existing `path` may be
// replaced only when Tessera wrote it, or it holds nothing. That is an empty directory, a
// Tessera checkpoint directory (with its metadata file), a Tessera safetensors file
// (consolidate, export --format safetensors) or a Tessera torch export (export --format
// torch, recognised by its marker record). Anything else is the user's, `--force` or not.
bool is_replaceable_output(const std::string& path);

// Refuses (tessera::Error naming the path) when `path` exists and is not something
// a save may replace (is_replaceable_output).
void check_replaceable(const std::string& path);

// What an offline command writes at its output path.
enum class OutputKind { File, Directory };

// The first check of every command that writes an output path (consolidate, reshard,
// export, import-dcp, import-xla), made before anything is written; each refusal names
// `out` and `command`. The path must not be a symbolic link (a link is neither replaced
// nor written through); a Directory output's name must not end in .safetensors (the name
// would misdescribe it); an absent path needs its parent directory; an existing one needs
// `force`. Returns whether `out` exists: what the command may then replace is its own rule
// (check_replaceable for a checkpoint). Trailing slashes are ignored ("dir/" is "dir").
bool check_output_path(const std::string& out, bool force, OutputKind kind, const std::string& command);

}  // namespace tessera::checkpoint
