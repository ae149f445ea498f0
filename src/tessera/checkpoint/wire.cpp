#include "tessera/checkpoint/wire.h"

#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

Packer& Packer::u64(uint64_t v) {
  for (int i = 0; i < 8; ++i) s_ += static_cast<char>((v >> (8 * i)) & 0xff);
  return *this;
}
Packer& Packer::str(const std::string& v) {
  u64(v.size());
  s_ += v;
  return *this;
}

void Unpacker::need(uint64_t n) const {
  TESSERA_CHECK(n <= s_.size() - pos_, "internal: ", what_, " is truncated (", s_.size(), " bytes)");
}
uint64_t Unpacker::u64() {
  need(8);
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s_[pos_ + i])) << (8 * i);
  pos_ += 8;
  return v;
}
std::string Unpacker::str() {
  const uint64_t n = u64();
  need(n);
  std::string v = s_.substr(pos_, n);
  pos_ += n;
  return v;
}

}  // namespace tessera::checkpoint
