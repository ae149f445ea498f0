// Zip structures read here (PKWARE APPNOTE 6.3): the end of central directory record
// (EOCD, "PK\5\6", at most 65,535 bytes of comment after it), the ZIP64 EOCD locator
// ("PK\6\7", the 20 bytes before the EOCD) and ZIP64 EOCD record ("PK\6\6"), the central
// directory's file headers ("PK\1\2", 46 bytes + name + extra + comment; ZIP64 extra
// field 0x0001 holding the 64-bit sizes and offset that are 0xFFFFFFFF in the header) and
// each record's local header ("PK\3\4", 30 bytes + name + extra: torch's writer pads the
// extra field so that the data starts on a 64-byte boundary).
#include "tessera/checkpoint/interop/zip_index.h"

#include <algorithm>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::checkpoint {
namespace {

uint64_t le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int k = n - 1; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

bool sig(const unsigned char* p, unsigned char c, unsigned char d) {
  return p[0] == 'P' && p[1] == 'K' && p[2] == c && p[3] == d;
}

// The central directory may not be larger than this (about 2 million records).
constexpr uint64_t kMaxDirectory = 256ull << 20;

}  // namespace

ZipIndex::ZipIndex(const File& f, std::string where) : f_(f), where_(std::move(where)) {
  const uint64_t size = f.size();
  TESSERA_CHECK(size >= 22, where_, " is not a zip archive (what torch.save writes): it has ", size, " bytes");
  const uint64_t tail_n = std::min<uint64_t>(size, 22 + 65535);
  std::vector<unsigned char> tail(tail_n);
  f.pread_exact(size - tail_n, tail.data(), tail_n);
  int64_t at = -1;  // EOCD position inside tail
  for (int64_t k = static_cast<int64_t>(tail_n) - 22; k >= 0; --k) {
    if (sig(&tail[k], 5, 6) && k + 22 + static_cast<int64_t>(le(&tail[k + 20], 2)) == static_cast<int64_t>(tail_n)) {
      at = k;
      break;
    }
  }
  TESSERA_CHECK(at >= 0, where_, " is not a zip archive (what torch.save writes): no end of central directory record");
  uint64_t count = le(&tail[at + 10], 2), dir_size = le(&tail[at + 12], 4), dir_offset = le(&tail[at + 16], 4);
  const uint64_t eocd = size - tail_n + static_cast<uint64_t>(at);
  if (eocd >= 20) {
    unsigned char loc[20];
    f.pread_exact(eocd - 20, loc, 20);
    if (sig(loc, 6, 7)) {
      const uint64_t z = le(loc + 8, 8);
      TESSERA_CHECK(z <= size && size - z >= 56, where_, ": the ZIP64 end of central directory lies outside the file");
      unsigned char rec[56];
      f.pread_exact(z, rec, 56);
      TESSERA_CHECK(sig(rec, 6, 6), where_, ": damaged ZIP64 end of central directory record");
      count = le(rec + 32, 8);
      dir_size = le(rec + 40, 8);
      dir_offset = le(rec + 48, 8);
    }
  }
  TESSERA_CHECK(dir_offset <= size && dir_size <= size - dir_offset, where_,
                ": the central directory lies outside the file (truncated?)");
  TESSERA_CHECK(dir_size <= kMaxDirectory, where_, ": a central directory of ", dir_size, " bytes (at most ",
                kMaxDirectory, ")");
  TESSERA_CHECK(count <= dir_size / 46, where_, ": ", count, " records do not fit a central directory of ", dir_size,
                " bytes");
  std::vector<unsigned char> dir(dir_size);
  if (dir_size) f.pread_exact(dir_offset, dir.data(), dir_size);
  uint64_t p = 0;
  for (uint64_t i = 0; i < count; ++i) {
    TESSERA_CHECK(p + 46 <= dir_size && sig(&dir[p], 1, 2), where_, ": damaged central directory (record ", i, ")");
    const unsigned char* h = &dir[p];
    ZipRecord r;
    r.method = static_cast<uint16_t>(le(h + 10, 2));
    uint64_t csize = le(h + 20, 4), usize = le(h + 24, 4), local = le(h + 42, 4);
    const uint64_t name_n = le(h + 28, 2), extra_n = le(h + 30, 2), comment_n = le(h + 32, 2);
    TESSERA_CHECK(p + 46 + name_n + extra_n + comment_n <= dir_size, where_, ": damaged central directory (record ", i,
                  ")");
    const std::string name(reinterpret_cast<const char*>(h + 46), name_n);
    // ZIP64 extra field: the 8-byte values of the fields that are 0xFFFFFFFF, in this order.
    for (uint64_t e = 0; e + 4 <= extra_n;) {
      const unsigned char* x = h + 46 + name_n + e;
      const uint64_t id = le(x, 2), n = le(x + 2, 2);
      TESSERA_CHECK(e + 4 + n <= extra_n, where_, ": damaged extra field of record '", name, "'");
      if (id == 1) {
        uint64_t q = 4;
        for (uint64_t* v : {&usize, &csize, &local}) {
          if (*v != 0xFFFFFFFFull) continue;
          TESSERA_CHECK(q + 8 <= 4 + n, where_, ": damaged ZIP64 field of record '", name, "'");
          *v = le(x + q, 8);
          q += 8;
        }
      }
      e += 4 + n;
    }
    p += 46 + name_n + extra_n + comment_n;
    TESSERA_CHECK(local <= size && size - local >= 30, where_, ": record '", name, "' starts outside the file");
    unsigned char lh[30];
    f.pread_exact(local, lh, 30);
    TESSERA_CHECK(sig(lh, 3, 4), where_, ": record '", name, "' has a damaged local header");
    const uint64_t start = local + 30 + le(lh + 26, 2) + le(lh + 28, 2);
    r.size = csize;
    r.offset = start;
    TESSERA_CHECK(start <= size && csize <= size - start, where_, ": record '", name, "' (", csize,
                  " bytes) reaches past the end of the file (", size, " bytes): truncated?");
    TESSERA_CHECK(r.method != 0 || csize == usize, where_, ": stored record '", name, "' has ", csize,
                  " bytes but declares ", usize);
    TESSERA_CHECK(records_.emplace(name, r).second, where_, ": record '", name, "' appears twice");
  }
}

const ZipRecord* ZipIndex::find(const std::string& name) const {
  auto it = records_.find(name);
  return it == records_.end() ? nullptr : &it->second;
}

std::string ZipIndex::read(const std::string& name, uint64_t max_bytes) const {
  const ZipRecord* r = find(name);
  TESSERA_CHECK(r, where_, ": no record '", name, "'");
  TESSERA_CHECK(r->method == 0, where_, ": record '", name, "' is compressed (method ", r->method,
                "); torch.save stores its records uncompressed");
  TESSERA_CHECK(r->size <= max_bytes, where_, ": record '", name, "' has ", r->size, " bytes (at most ", max_bytes,
                " are read)");
  std::string s(r->size, '\0');
  if (r->size) f_.pread_exact(r->offset, s.data(), r->size);
  return s;
}

}  // namespace tessera::checkpoint
