#include "tessera/checkpoint/format/checksum.h"

#include <cstring>

#include "tessera/core/error.h"

namespace tessera::checkpoint {

void check_crc_block(uint64_t block, const std::string& what) {
  TESSERA_CHECK(block >= kMinCrcBlock && block <= kMaxCrcBlock && block % 8 == 0, what, ": checksum block size ",
                block, " is not a multiple of 8 bytes between ", kMinCrcBlock, " and ", kMaxCrcBlock,
                " (corrupt or tampered)");
}

std::vector<std::vector<uint32_t>> assemble_block_crcs(std::vector<CrcPiece> pieces,
                                                       const std::vector<std::pair<std::string, uint64_t>>& tensors,
                                                       const std::string& file, uint64_t block) {
  std::sort(pieces.begin(), pieces.end(), [](const CrcPiece& a, const CrcPiece& b) {
    return a.tensor != b.tensor ? a.tensor < b.tensor : a.begin < b.begin;
  });
  std::vector<std::vector<uint32_t>> out(tensors.size());
  size_t i = 0;
  for (uint32_t t = 0; t < tensors.size(); ++t) {
    const std::string& name = tensors[t].first;  // not a structured binding: the lambda captures it (clang, C++17)
    const uint64_t bytes = tensors[t].second;
    auto where = [&](uint64_t a, uint64_t b) { return concat("'", file, "' tensor '", name, "': bytes ", a, "..", b); };
    uint64_t at = 0;  // every byte before `at` is covered
    for (uint64_t b0 = 0; b0 < bytes; b0 += block) {
      const uint64_t b1 = std::min(bytes, b0 + block);
      uint32_t crc = 0;
      for (; i < pieces.size() && pieces[i].tensor == t && pieces[i].begin < b1; ++i) {
        const CrcPiece& p = pieces[i];
        TESSERA_CHECK(p.begin <= at, where(at, p.begin), " were written by no writer");
        TESSERA_CHECK(p.begin == at, where(p.begin, at), " were written twice");
        TESSERA_CHECK(p.len > 0 && p.begin + p.len <= b1, where(p.begin, p.begin + p.len),
                      ": a checksum piece that crosses a block boundary or the tensor's end");
        crc = at == b0 ? p.crc : crc32c_combine(crc, p.crc, p.len);
        at += p.len;
      }
      TESSERA_CHECK(at == b1, where(at, b1), " were written by no writer");
      out[t].push_back(crc);
    }
    TESSERA_CHECK(i == pieces.size() || pieces[i].tensor != t, where(pieces[i].begin, pieces[i].begin + pieces[i].len),
                  " lie past the tensor's ", bytes, " bytes");
  }
  TESSERA_CHECK(i == pieces.size(), "'", file, "': a checksum piece names tensor ", pieces[i].tensor, " of ",
                tensors.size());
  return out;
}

std::string pack_crc_pieces(const std::vector<CrcPiece>& pieces) {
  std::string s(pieces.size() * 24, '\0');
  char* q = s.data();
  for (const auto& p : pieces) {  // little-endian hosts only (checked by the writers)
    std::memcpy(q, &p.tensor, 4);
    std::memcpy(q + 4, &p.begin, 8);
    std::memcpy(q + 12, &p.len, 8);
    std::memcpy(q + 20, &p.crc, 4);
    q += 24;
  }
  return s;
}

std::vector<CrcPiece> unpack_crc_pieces(const std::string& bytes, const std::string& what) {
  TESSERA_CHECK(bytes.size() % 24 == 0, what, ": ", bytes.size(), " bytes of checksum pieces, not a multiple of 24");
  std::vector<CrcPiece> out(bytes.size() / 24);
  const char* q = bytes.data();
  for (auto& p : out) {
    std::memcpy(&p.tensor, q, 4);
    std::memcpy(&p.begin, q + 4, 8);
    std::memcpy(&p.len, q + 12, 8);
    std::memcpy(&p.crc, q + 20, 4);
    q += 24;
  }
  return out;
}

}  // namespace tessera::checkpoint
