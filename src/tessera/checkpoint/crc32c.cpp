#include "tessera/checkpoint/crc32c.h"

#include <array>
#include <cstring>

#include "tessera/core/error.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace tessera::checkpoint {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // 0x1EDC6F41 reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
  }
};
const Tables& tables() {
  static const Tables tb;
  return tb;
}

uint32_t portable_raw(uint32_t c, const unsigned char* p, size_t n) {
  const auto& t = tables().t;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (checked in the writer)
    w ^= c;
    c = t[7][w & 0xff] ^ t[6][(w >> 8) & 0xff] ^ t[5][(w >> 16) & 0xff] ^ t[4][(w >> 24) & 0xff] ^
        t[3][(w >> 32) & 0xff] ^ t[2][(w >> 40) & 0xff] ^ t[1][(w >> 48) & 0xff] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = t[0][(c ^ *p++) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hw_raw(uint32_t c, const unsigned char* p, size_t n) {
  uint64_t c64 = c;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c64 = _mm_crc32_u8(static_cast<uint32_t>(c64), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c64 = _mm_crc32_u64(c64, w);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c64);
  while (n--) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}
bool detect_hw() { return __builtin_cpu_supports("sse4.2"); }
#else
bool detect_hw() { return false; }
#endif

}  // namespace

bool crc32c_hardware() {
  static const bool hw = detect_hw();
  return hw;
}

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  return ~portable_raw(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (crc32c_hardware()) return ~hw_raw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return crc32c_extend_portable(crc, data, n);
}

std::vector<uint32_t> block_crcs(const void* data, size_t n, uint64_t block) {
  std::vector<uint32_t> out;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t off = 0; off < n; off += block) out.push_back(crc32c(p + off, std::min<uint64_t>(block, n - off)));
  return out;
}

std::string crc_hex(uint32_t crc) {
  static const char* d = "0123456789abcdef";
  std::string s(8, '0');
  for (int i = 7; i >= 0; --i, crc >>= 4) s[i] = d[crc & 0xf];
  return s;
}

uint32_t parse_crc_hex(const std::string& s, const std::string& what) {
  TESSERA_CHECK(s.size() == 8, what, ": checksum '", s, "' is not 8 hex digits");
  uint32_t v = 0;
  for (char ch : s) {
    int x;
    if (ch >= '0' && ch <= '9') x = ch - '0';
    else if (ch >= 'a' && ch <= 'f') x = ch - 'a' + 10;
    else if (ch >= 'A' && ch <= 'F') x = ch - 'A' + 10;
    else throw Error(concat(what, ": checksum '", s, "' is not 8 hex digits"));
    v = (v << 4) | static_cast<uint32_t>(x);
  }
  return v;
}

}  // namespace tessera::checkpoint
