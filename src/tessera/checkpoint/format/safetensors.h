// safetensors files: a streaming writer (one tensor at a time, block checksums
// patched into the header at the end) and a strictly validating reader that reads
// byte ranges with pread, never the whole file. Layout in docs/checkpoint-format.md §1.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "tessera/checkpoint/storage/file.h"
#include "tessera/checkpoint/storage/stream_writer.h"
#include "tessera/core/error.h"

namespace tessera::checkpoint {

// A read that failed for want of a resource of the process or the system (file
// descriptors), not because of anything in the checkpoint. The message names the limit.
// `tessera ckpt verify` reports it as an error (exit 2), never as corruption.
class ResourceError : public Error {
 public:
  using Error::Error;
};

// `path` opened for reading. Throws ResourceError naming RLIMIT_NOFILE when the process
// (or the system) has no descriptor left, tessera::Error naming the path otherwise.
File open_for_reading(const std::string& path);

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// "F32", "BF16", ...; throws for dtypes safetensors cannot hold.
std::string dtype_name(at::ScalarType t);
// Throws tessera::Error naming `what` for an unknown name.
at::ScalarType parse_dtype(const std::string& name, const std::string& what);
size_t itemsize(at::ScalarType t);
// prod(shape) * itemsize, with overflow checks (error naming `what`).
uint64_t byte_size(const std::vector<int64_t>& shape, at::ScalarType t, const std::string& what);

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // absolute offsets in the file
  uint64_t end = 0;
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  // Opens and validates the header (size bound, JSON, dtypes, shapes, offsets inside
  // the file, contiguous coverage, and for a file with Tessera metadata the
  // tessera.header_crc32c checksum of the header bytes). Errors name the file and the tensor.
  explicit SafetensorsReader(const std::string& path);

  const std::string& path() const { return path_; }
  // In header order.
  const std::vector<TensorEntry>& entries() const { return entries_; }
  const TensorEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The value of a __metadata__ key, or "" when absent.
  std::string meta(const std::string& key) const;
  uint64_t file_size() const { return size_; }
  // Block checksums of a tensor from "tessera.crc32c" (nullptr when the file has none).
  const std::vector<uint32_t>* crcs(const std::string& name) const;
  uint64_t crc_block() const { return crc_block_; }
  // The open file the header was read from. After close_file(), opens the path again and
  // checks that it is still that file (same device and inode): a file renamed over the
  // path since (a checkpoint committed while this one is read) is an error, never read
  // against this header's checksums.
  const File& file() const;
  // Closes the descriptor; the parsed header stays (readers of checkpoints with many
  // data files keep a bounded number open).
  void close_file() const { file_.close(); }
  bool file_open() const { return file_.is_open(); }

  // The whole tensor, its checksums verified when the file has them.
  at::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  mutable File file_;
  uint64_t dev_ = 0, ino_ = 0;  // of the file the header was read from
  uint64_t size_ = 0;
  std::vector<TensorEntry> entries_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, std::vector<uint32_t>> crcs_;
  uint64_t crc_block_ = 0;
};

// `t` as dense, contiguous CPU memory (a copy only when it is not already).
at::Tensor dense_cpu(const at::Tensor& t);

struct TensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

// Where everything goes in a safetensors file Tessera writes, decided before any data:
// the header (checksum placeholders included), each tensor's byte range, and where the
// block checksums and the header checksum are patched in once the data is written.
struct SafetensorsLayout {
  std::vector<TensorEntry> tensors;  // in spec order, absolute offsets
  std::string prefix;                // what goes at offset 0: 8 length bytes and the header text
  uint64_t crc_pos = 0;              // file offset of tessera.crc32c's hex digits
  uint64_t header_crc_pos = 0;       // file offset of tessera.header_crc32c's 8 hex digits
  uint64_t data_start() const { return prefix.size(); }
  uint64_t file_size() const { return tensors.empty() ? prefix.size() : tensors.back().end; }
  // The final header (as `prefix`) once every tensor's block checksums are known.
  std::string final_prefix(const std::vector<std::vector<uint32_t>>& crcs) const;
};
// Appends `s` as a JSON string, exactly as nlohmann::json's dump() writes it (quotes and
// backslashes escaped, control characters and UTF-8 as nlohmann escapes and checks them).
void append_json_string(std::string& out, std::string_view s);

// Lays out `specs` (names unique, none "__metadata__"); `metadata` goes into
// __metadata__ next to Tessera's own keys. Errors name `path`.
SafetensorsLayout layout_safetensors(const std::string& path, const std::vector<TensorSpec>& specs,
                                     std::map<std::string, std::string> metadata);

class SafetensorsWriter {
 public:
  using Spec = TensorSpec;
  struct Written {
    std::string name;
    uint64_t begin = 0, end = 0;  // absolute offsets in the file
    std::vector<uint32_t> crcs;
  };
  // Creates `path` and writes the header for `specs` (names unique, none "__metadata__").
  // `metadata` goes into __metadata__ next to Tessera's own keys.
  SafetensorsWriter(const std::string& path, std::vector<Spec> specs, std::map<std::string, std::string> metadata);
  ~SafetensorsWriter();
  // Writes the next tensor; it must match the next spec's dtype and shape (any
  // device/layout: a contiguous CPU copy is made when needed).
  void write(const at::Tensor& t);
  // Writes the next tensor in pieces: consecutive runs of rows (dim 0) of the declared
  // shape, in order; the tensor is done when all its bytes are written. Lets a caller
  // stream a tensor it never holds whole (consolidated save of a sharded tensor).
  void write_part(const at::Tensor& rows);
  // Patches the checksums into the header, fsyncs and closes. Every spec must have been
  // written. With `unsynced`, the file is moved there open and not yet fsynced
  // (StreamWriter::finish).
  std::vector<Written> finish(File* unsynced = nullptr);
  size_t next_index() const { return next_; }

 private:
  std::unique_ptr<StreamWriter> out_;
  std::string path_;
  std::vector<Spec> specs_;
  SafetensorsLayout layout_;
  std::vector<Written> written_;
  size_t next_ = 0;
  void append(const void* data, uint64_t n);
  uint64_t part_bytes_ = 0;  // bytes of the current tensor written so far
  uint32_t block_crc_ = 0;   // checksum of the current block so far
  uint64_t block_fill_ = 0;  // bytes in the current block
  bool finished_ = false;
};

}  // namespace tessera::checkpoint
