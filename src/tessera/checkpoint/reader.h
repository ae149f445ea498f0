// Reading checkpoints of every kind through one description (CheckpointMetadata):
// open_checkpoint() recognises a sharded directory, a Hugging Face model directory
// (interop/hf_dir.h), a safetensors file (Tessera's consolidated format or anyone's) and a
// torch.save'd dict of tensors; ChunkReader
// reads the part of a chunk a caller needs with pread, verifying the checksum blocks
// it reads.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <list>
#include <set>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tessera/checkpoint/format/metadata.h"
#include "tessera/checkpoint/format/safetensors.h"
#include "tessera/checkpoint/storage/direct_reader.h"
#include "tessera/checkpoint/storage/file.h"

namespace tessera::checkpoint {

// Opens and validates the metadata at `path` (a Hugging Face directory: its index and shard
// headers, checked against each other). A missing directory whose previous version was
// left aside by an interrupted commit is read from there.
CheckpointMetadata open_checkpoint(const std::string& path);
// The same for a path checked where it entered (a load): not checked again.
CheckpointMetadata open_checkpoint(const CheckedPath& path);

// Whether `path` holds something Tessera wrote (a directory with metadata, or a
// safetensors file whose header names a Tessera format).
bool is_tessera_checkpoint(const std::string& path);

// Why `path` is no Tessera checkpoint at all, intact or damaged ("" when it may be one): a
// directory that is another system's checkpoint (DCP, torch_xla rank files), a directory of
// other safetensors files or any other directory without the metadata file, or a Python
// pickle in place of a file; the message says what it is and how to read it (import-dcp,
// import-xla, ...). open_checkpoint() throws it; `tessera ckpt verify` reports such an input
// as not a checkpoint (exit 2) rather than a corrupt one (exit 1).
std::string not_a_checkpoint_reason(const std::string& path);

class ChunkReader {
 public:
  // Keeps at most max_open_files() data files open at once (each may hold a second, O_DIRECT
  // descriptor): a checkpoint with more data files than the process may open is read by
  // closing the least recently used and opening it again when needed (the same file:
  // SafetensorsReader::file()).
  explicit ChunkReader(const CheckpointMetadata& meta);
  // The chunks of entry `fqn` that overlap `box`, located. Version 1 and the single-file
  // sources: those of the metadata's list. Version 2: the pieces the entry's layout puts
  // there, found in the headers of the data files that hold them (and no others), each
  // checked there (present, dtype, shape) and each file checked to belong to this save
  // and rank (tessera.save_id, tessera.rank).
  std::vector<ChunkInfo> chunks(const std::string& fqn, const EntryInfo& e, const sharding::Box& box);
  // Every chunk of an entry, located (and checked) once by chunks() for a caller that then
  // reads many boxes of it (a reshard to many ranks): fill_box(.., located, ..) finds the
  // chunks a box needs by the layout's binary search, with no data-file header lookup.
  struct Located {
    std::vector<ChunkInfo> chunks;  // chunks(fqn, e, whole), in that order
    std::vector<int64_t> pieces;    // version 2: the layout's piece index of each, ascending
  };
  Located locate(const std::string& fqn, const EntryInfo& e);
  // Version 2: opens data file `rank` and checks, the first time, that it belongs to this
  // save and rank and holds exactly the pieces the layouts place there: each present with
  // the entry's dtype and the piece's shape, at the piece's offsets where the file records
  // them (tessera.offsets), and no other tensor. O(entries) per file.
  const SafetensorsReader& data_file(int64_t rank);
  // What `tessera ckpt verify` checks of the structure before it reads a tensor byte, for
  // the data files part, part + parts, ... (a share for each of `parts` ranks): version 2,
  // every data file present and passing data_file()'s checks; version 1, every listed file
  // present and valid. Throws naming the first problem. Every reader of a whole checkpoint
  // (consolidate, reshard, export, load) calls it first, so that a checkpoint verify refuses
  // never comes out of them as a clean one.
  void check_structure(int part = 0, int parts = 1);
  // Copies the overlap of chunk `c` (of entry `fqn`) with `dst_box` into `dst`, which
  // holds the elements of `dst_box`. Reads only the checksum blocks that cover the
  // overlap, and checks them; blocks this reader already checked are not read again
  // whole (only the overlap's bytes). Returns the number of elements copied.
  int64_t copy_into(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c, at::Tensor& dst,
                    const sharding::Box& dst_box);
  // Asks the kernel to start reading the bytes copy_into(fqn, e, c, ., dst_box) will
  // read (read-ahead); returns their count. Ranges of DirectReader::kMinBytes and more
  // are read by copy_into with O_DIRECT, two segments in flight (DirectReader), so no
  // advice is given for them where the file allows direct reads (it would fill the
  // page cache with pages the direct reads then pass by).
  uint64_t prefetch(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c, const sharding::Box& dst_box);
  // A tensor of `box` (inside the entry's shape) assembled from every chunk; an error
  // naming the key unless the chunks cover every element of `box`.
  at::Tensor read_box(const std::string& fqn, const EntryInfo& e, const sharding::Box& box);
  // Copies every chunk's overlap with `box` into `dst` (holding `box`); an error naming
  // the key and `what` unless they cover every element of it (what a writer of output
  // checks before it writes the tensor).
  void fill_box(const std::string& fqn, const EntryInfo& e, at::Tensor& dst, const sharding::Box& box,
                const std::string& what);
  // The same from the chunks locate(fqn, e) returned.
  void fill_box(const std::string& fqn, const EntryInfo& e, const Located& located, at::Tensor& dst,
                const sharding::Box& box, const std::string& what);
  // Reads every block of the chunk and checks it (and the data file's header entry).
  void verify_chunk(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c);
  // The (validated) safetensors reader of a data file, its file open.
  const SafetensorsReader& reader(const std::string& file);
  // How many data files a ChunkReader keeps open: an eighth of RLIMIT_NOFILE's soft limit,
  // between 2 and 128.
  static size_t max_open_files();

 private:
  void check_header_entry(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c);
  // Version 2: piece i of the entry's layout, located in its data file and checked there.
  ChunkInfo locate_piece(const std::string& fqn, const EntryInfo& e, int64_t i);
  void check_covered(const std::string& fqn, int64_t n, const sharding::Box& box, const std::string& what) const;
  void check_contents(int64_t rank, const SafetensorsReader& r, const std::string& where) const;
  // Checks the checksum blocks of chunk `c` (of data file `path`) that `data` holds: the
  // n bytes from byte `base` of the chunk (block-aligned; the last block may be the
  // chunk's short one). Runs on DirectReader's workers: touches no member but meta_.
  void check_blocks(const std::string& path, const std::string& fqn, const ChunkInfo& c, uint64_t base,
                    const char* data, uint64_t n) const;
  // The bytes [b0, b1) of chunk `c` (relative to its start) that hold its overlap `ov`,
  // widened to whole checksum blocks.
  struct Range {
    uint64_t b0 = 0, b1 = 0;
    int64_t first = 0, last = 0;  // first and last element of the overlap in the chunk
    uint64_t block = 0;           // checksum block size (the whole chunk when it has none)
    bool exact = false;           // [b0, b1) is the overlap's own bytes (no widening)
    std::vector<int64_t> strides;
  };
  Range range_of(const std::string& fqn, const EntryInfo& e, const ChunkInfo& c, const sharding::Box& ov) const;
  // Closes the least recently used data files until fewer than `keep` are open.
  void close_files(size_t keep);
  const CheckpointMetadata& meta_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
  std::set<int64_t> identified_;  // version 2: data files whose identity was checked
  // The checksum blocks verified so far, per chunk (data file path, chunk's first byte):
  // a later read inside them reads only its own bytes.
  std::map<std::pair<std::string, uint64_t>, std::vector<bool>> checked_;
  std::list<std::string> open_;  // data files with an open descriptor, most recently used first
  size_t max_open_;
  DirectReader io_;  // its worker threads start at the first large read
  std::vector<char> verify_buf_;  // verify_chunk's window
};

// Pieces read one after another while the kernel is already reading the pieces after
// them: before piece i is read, the byte ranges of the following pieces are requested
// (ChunkReader::prefetch, posix_fadvise WILLNEED) until `window` bytes are in flight, so
// the disk never waits for the copy and checksum of the current piece and small pieces
// do not each wait for the disk. Used by load() and by consolidation.
class ReadAhead {
 public:
  // prefetch(i) requests piece i's ranges and returns their bytes.
  ReadAhead(size_t pieces, std::function<uint64_t(size_t)> prefetch, uint64_t window = kWindow)
      : prefetch_(std::move(prefetch)), fetched_(pieces, 0), window_(window) {}
  // Call before reading piece i, for i = 0, 1, ... in order.
  void before(size_t i) {
    if (i > 0) ahead_ -= fetched_[i - 1];  // piece i - 1 has been read
    while (next_ < fetched_.size() && (next_ <= i || ahead_ < window_)) {
      fetched_[next_] = prefetch_(next_);
      ahead_ += fetched_[next_++];
    }
  }
  static constexpr uint64_t kWindow = 64u << 20;

 private:
  std::function<uint64_t(size_t)> prefetch_;
  std::vector<uint64_t> fetched_;
  uint64_t window_, ahead_ = 0;
  size_t next_ = 0;  // first piece not yet requested
};

}  // namespace tessera::checkpoint
