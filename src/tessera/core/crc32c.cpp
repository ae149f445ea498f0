#include "tessera/core/crc32c.h"

#include <array>
#include <cstring>

#include "tessera/core/error.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace tessera::core {
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
// The crc32 instruction has a latency of 3 cycles but issues every cycle, so one
// dependent stream uses a third of it. Long inputs are cut into rounds of three
// kStride-byte pieces whose CRCs are computed side by side (each piece from a zero
// state) and then joined: the raw CRC register is linear, so
//   crc(c, A || B) = crc(crc(c, A), B) = shift(crc(c, A)) ^ crc(0, B)
// where shift(x) = crc(x, kStride zero bytes), a linear map of x applied with four
// byte-indexed tables built once from its values on the 32 basis vectors.
constexpr size_t kStride = 4096;

__attribute__((target("sse4.2"))) uint32_t hw_zeros(uint32_t c, size_t n) {
  uint64_t c64 = c;
  for (size_t i = 0; i < n / 8; ++i) c64 = _mm_crc32_u64(c64, 0);
  return static_cast<uint32_t>(c64);
}

struct ShiftTables {
  uint32_t t[4][256];
  ShiftTables() {
    uint32_t basis[32];
    for (int b = 0; b < 32; ++b) basis[b] = hw_zeros(1u << b, kStride);
    for (int k = 0; k < 4; ++k)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t x = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) x ^= basis[8 * k + bit];
        t[k][v] = x;
      }
  }
  uint32_t shift(uint32_t c) const {
    return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
  }
};
const ShiftTables& shift_tables() {
  static const ShiftTables st;
  return st;
}

__attribute__((target("sse4.2"))) uint32_t hw_raw(uint32_t c, const unsigned char* p, size_t n) {
  uint64_t c64 = c;
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    c64 = _mm_crc32_u8(static_cast<uint32_t>(c64), *p++);
    --n;
  }
  if (n >= 3 * kStride) {
    const ShiftTables& st = shift_tables();
    while (n >= 3 * kStride) {
      uint64_t a = c64, b = 0, d = 0;
      const unsigned char* q = p;
      for (size_t i = 0; i < kStride; i += 8, q += 8) {
        uint64_t wa, wb, wd;
        std::memcpy(&wa, q, 8);
        std::memcpy(&wb, q + kStride, 8);
        std::memcpy(&wd, q + 2 * kStride, 8);
        a = _mm_crc32_u64(a, wa);
        b = _mm_crc32_u64(b, wb);
        d = _mm_crc32_u64(d, wd);
      }
      uint32_t joined = st.shift(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
      c64 = st.shift(joined) ^ static_cast<uint32_t>(d);
      p += 3 * kStride;
      n -= 3 * kStride;
    }
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

namespace {
// Polynomials over GF(2) modulo the CRC polynomial, in the CRC's reflected bit order:
// bit 31 holds the coefficient of x^0, bit 0 that of x^31.
uint32_t mul_mod_poly(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = 1u << 31; bit != 0; bit >>= 1) {  // x^0, x^1, ... of a
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return product;
}
// x^(2^k) mod P for k = 0..63, by repeated squaring of x.
const std::array<uint32_t, 64>& x_pow2k() {
  static const std::array<uint32_t, 64> t = [] {
    std::array<uint32_t, 64> a{};
    a[0] = 1u << 30;  // x
    for (size_t k = 1; k < a.size(); ++k) a[k] = mul_mod_poly(a[k - 1], a[k - 1]);
    return a;
  }();
  return t;
}
}  // namespace

// crc(A || B) = crc(A) * x^(8 |B|) + crc(B) (mod P): the pre- and post-inversions of
// the two CRCs cancel in the sum, so the conditioned values combine directly.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  uint32_t shift = 1u << 31;  // x^0
  const auto& t = x_pow2k();
  uint64_t bits = len_b;
  for (size_t k = 3; bits != 0 && k < t.size(); ++k, bits >>= 1)  // x^(8 len_b) = x^(len_b 2^3)
    if (bits & 1) shift = mul_mod_poly(shift, t[k]);
  return mul_mod_poly(crc_a, shift) ^ crc_b;
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

}  // namespace tessera::core
