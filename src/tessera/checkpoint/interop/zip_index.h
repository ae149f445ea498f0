// The records of a zip archive (the container of torch.save files) located without
// reading them: for each record its name, where its bytes start in the file and how many
// there are, from the central directory (ZIP64 included) and each record's local header.
// A reader then preads exactly the bytes it needs of a record (one tensor of a storage)
// instead of extracting the record whole, as PyTorchStreamReader::getRecord does.
//
// The input is untrusted: every offset and size is checked against the file's size, the
// central directory is bounded, names appear once, and only stored (uncompressed) records
// can be read (torch.save writes nothing else); a compressed one is an error naming it
// when read. The records' CRC-32s are not checked (torch.load's mmap path does not either).
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "tessera/checkpoint/storage/file.h"

namespace tessera::checkpoint {

struct ZipRecord {
  uint64_t offset = 0;  // absolute file offset of the record's first byte
  uint64_t size = 0;    // bytes as stored
  uint16_t method = 0;  // 0: stored; anything else cannot be read here
};

class ZipIndex {
 public:
  // Reads the central directory of `f`. Errors start with `where` (the file, quoted).
  ZipIndex(const File& f, std::string where);

  // nullptr when there is no record of that name.
  const ZipRecord* find(const std::string& name) const;
  const std::map<std::string, ZipRecord>& records() const { return records_; }
  // The whole record `name` (stored, at most `max_bytes`), or an error naming it.
  std::string read(const std::string& name, uint64_t max_bytes) const;

 private:
  const File& f_;
  std::string where_;
  std::map<std::string, ZipRecord> records_;
};

}  // namespace tessera::checkpoint
