// `tessera ckpt import-dcp` on a DCP directory made of the input: a 4-byte little-endian
// length, that many bytes of `.metadata` (DCP's pickled Metadata), and the rest as the
// one data file `__0_0.distcp` (torch.save archives at the offsets the metadata names).
// Errors are clean; an import that succeeds is written to a scratch directory and removed.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "tessera/checkpoint/offline/dcp_import.h"
#include "tessera/checkpoint/storage/file.h"

namespace ck = tessera::checkpoint;

namespace {

void write_file(const std::string& path, const char* data, size_t n) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return;
  if (n) std::fwrite(data, 1, n, f);
  std::fclose(f);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = "/tmp/tessera-fuzz-dcp-" + std::to_string(::getpid());
  static const std::string out = dir + "-out";
  if (!ck::path_exists(dir)) ck::make_dir(dir);
  if (size < 4) return 0;
  uint64_t n = 0;
  for (int k = 0; k < 4; ++k) n |= static_cast<uint64_t>(data[k]) << (8 * k);
  if (n > size - 4) n = size - 4;
  const char* p = reinterpret_cast<const char*>(data) + 4;
  write_file(dir + "/.metadata", p, n);
  write_file(dir + "/__0_0.distcp", p + n, size - 4 - n);
  try {
    (void)ck::import_dcp(dir, out, false);
  } catch (const std::exception&) {
  }
  try {
    if (ck::path_exists(out)) ck::remove_all(out);
  } catch (const std::exception&) {
  }
  return 0;
}
