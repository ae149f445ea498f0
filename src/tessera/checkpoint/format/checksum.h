// The checkpoint format's checksums: CRC32C (core/crc32c.h) over fixed-size blocks of
// each tensor's bytes, so a reader verifies what it reads without reading the rest.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/crc32c.h"

namespace tessera::checkpoint {

using core::crc32c;
using core::crc32c_combine;
using core::crc32c_extend;
using core::crc_hex;
using core::parse_crc_hex;

// Checksum block size of format version 1.
constexpr uint64_t kCrcBlock = 4u << 20;

// The checksum block sizes a reader accepts (docs/checkpoint-format.md §1, §3): a multiple
// of 8, so that every block starts on an element of every dtype (the reader widens a byte
// range to whole blocks and reads elements from the block's start), and at most 1 GiB,
// so that reading one element never means reading more than that.
constexpr uint64_t kMinCrcBlock = 8;
constexpr uint64_t kMaxCrcBlock = 1ull << 30;
// Throws tessera::Error naming `what` for a block size outside those bounds.
void check_crc_block(uint64_t block, const std::string& what);

// Number of blocks of a byte length (no wrap for any block > 0).
inline uint64_t num_blocks(uint64_t bytes, uint64_t block = kCrcBlock) {
  return bytes / block + (bytes % block != 0 ? 1 : 0);
}

// One checksum per `block` bytes of [data, data + n) (the last one may be shorter).
inline std::vector<uint32_t> block_crcs(const void* data, size_t n, uint64_t block = kCrcBlock) {
  std::vector<uint32_t> out;
  out.reserve(num_blocks(n, block));
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t off = 0; off < n; off += block) out.push_back(crc32c(p + off, std::min<uint64_t>(block, n - off)));
  return out;
}

// The checksum of part of one block of a tensor, as one writer of a file that several
// write together computed it: bytes [begin, begin + len) of tensor `tensor` (offsets
// from the tensor's first byte), all inside one block.
struct CrcPiece {
  uint32_t tensor = 0;
  uint64_t begin = 0;
  uint64_t len = 0;
  uint32_t crc = 0;
};

// Each tensor's block checksums from the pieces of all writers, in any order
// (crc32c_combine joins the parts of a block). The pieces of every block must tile it
// exactly: a gap (bytes nobody wrote), an overlap or a piece outside the tensor is an
// error naming `file`, the tensor and the byte range. `tensors`: (name, byte size).
std::vector<std::vector<uint32_t>> assemble_block_crcs(std::vector<CrcPiece> pieces,
                                                       const std::vector<std::pair<std::string, uint64_t>>& tensors,
                                                       const std::string& file, uint64_t block = kCrcBlock);

// Binary form of pieces, for exchanging them between ranks (24 bytes each, little-endian).
std::string pack_crc_pieces(const std::vector<CrcPiece>& pieces);
std::vector<CrcPiece> unpack_crc_pieces(const std::string& bytes, const std::string& what);

}  // namespace tessera::checkpoint
