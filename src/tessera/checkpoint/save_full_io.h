// The consolidated save's own I/O (save_full.cpp): several ranks writing runs of one file
// at their offsets, the ranges they wrote and their checksums, and the read-back that
// checks those bytes before the commit. Internal to the checkpoint layer.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessera/checkpoint/format/checksum.h"
#include "tessera/checkpoint/storage/stream_writer.h"

namespace tessera::checkpoint {

// A byte range of a file and the checksum of the bytes written there.
struct WrittenRange {
  uint64_t at = 0;
  uint64_t len = 0;
  uint32_t crc = 0;
};
std::string pack_ranges(const std::vector<WrittenRange>& ranges);
std::vector<WrittenRange> unpack_ranges(const std::string& bytes, const std::string& what);

// One rank's part of a consolidated file that several ranks write at once: runs of
// bytes of tensors, each at its offset, checksummed per block of its tensor as it is
// copied (the pieces rank 0 joins into the header's block checksums). It also records
// the checksum of each run's bytes in the run's first and last page (io_page_size()):
// the pages it may share with another writer, where an incoherent filesystem or a
// wrong page size loses bytes.
class RunWriter {
 public:
  // `tensors`: each tensor's (file offset, byte size).
  RunWriter(const std::string& path, std::vector<std::pair<uint64_t, uint64_t>> tensors);
  // Writes `t` (any device, layout) at byte `off` of tensor `ti`.
  void write(size_t ti, uint64_t off, const at::Tensor& t);
  void finish();
  const std::vector<CrcPiece>& pieces() const { return pieces_; }
  const std::vector<WrittenRange>& edges() const { return edges_; }

 private:
  void note_edges(uint64_t at, const unsigned char* p, uint64_t n);
  void close_run();
  StreamWriter out_;
  std::vector<std::pair<uint64_t, uint64_t>> tensors_;
  std::vector<CrcPiece> pieces_;
  std::vector<WrittenRange> edges_;
  uint64_t page_;
  bool in_run_ = false;
  uint64_t run_start_ = 0, run_end_ = 0;
  WrittenRange head_, tail_;
};

// The ranges of `pieces` (bytes of tensors) in the file: piece p is at
// tensor_offsets[p.tensor] + p.begin.
std::vector<WrittenRange> piece_ranges(const std::vector<CrcPiece>& pieces, const std::vector<uint64_t>& tensor_offsets);

// Reads back `ranges` of `path`, which `writer` ("rank 1") wrote, and checks each against
// the checksum it was written with. Reads past this host's page cache: O_DIRECT where the
// filesystem allows (DirectReader), else after dropping the cached pages. `tensors`: each
// tensor's (file offset, key), in file order, to name the key in the error. Throws
// tessera::Error naming the file, the bytes, the key and the writer at the first range
// that differs.
void verify_read_back(const std::string& path, std::vector<WrittenRange> ranges,
                      const std::vector<std::pair<uint64_t, std::string>>& tensors, const std::string& writer);

// Which kernel (and so which page cache) this process runs on: the boot id, and the host
// name where there is none. Ranks that print the same share a page cache.
std::string kernel_identity();

}  // namespace tessera::checkpoint
