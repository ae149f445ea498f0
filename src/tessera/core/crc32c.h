// CRC32C (Castagnoli, the iSCSI/ext4 checksum): hardware instruction where the CPU
// has it (SSE4.2 on x86-64), a slice-by-8 table otherwise. crc32c("123456789") ==
// 0xe3069283.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tessera::core {

// Extends `crc` (the value returned for the bytes before) over [data, data + n).
// Start with 0.
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
// The checksum of A || B from crc32c(A), crc32c(B) and the length of B: what writers
// that each checksum their own part of a block need to produce the block's checksum.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);
// The portable implementation, whatever the CPU (for tests).
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
// Whether crc32c_extend uses the CPU instruction.
bool crc32c_hardware();

std::string crc_hex(uint32_t crc);  // 8 lowercase hex digits
// Parses 8 hex digits; throws tessera::Error naming `what` otherwise.
uint32_t parse_crc_hex(const std::string& s, const std::string& what);

}  // namespace tessera::core
