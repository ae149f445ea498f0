// The checkpoint format's checksums: CRC32C (core/crc32c.h) over fixed-size blocks of
// each tensor's bytes, so a reader verifies what it reads without reading the rest.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tessera/core/crc32c.h"

namespace tessera::checkpoint {

using core::crc32c;
using core::crc32c_extend;
using core::crc_hex;
using core::parse_crc_hex;

// Checksum block size of format version 1.
constexpr uint64_t kCrcBlock = 4u << 20;

// Number of blocks of a byte length.
inline uint64_t num_blocks(uint64_t bytes, uint64_t block = kCrcBlock) { return (bytes + block - 1) / block; }

// One checksum per `block` bytes of [data, data + n) (the last one may be shorter).
inline std::vector<uint32_t> block_crcs(const void* data, size_t n, uint64_t block = kCrcBlock) {
  std::vector<uint32_t> out;
  out.reserve(num_blocks(n, block));
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t off = 0; off < n; off += block) out.push_back(crc32c(p + off, std::min<uint64_t>(block, n - off)));
  return out;
}

}  // namespace tessera::checkpoint
