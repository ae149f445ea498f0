// The sharded checkpoint's metadata JSON: parse errors, bad shapes, chunks that do not
// tile, and file names that leave the directory must all be clean errors.
#include <cstdint>
#include <exception>
#include <string>

#include "tessera/checkpoint/format/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  try {
    auto m = tessera::checkpoint::parse_metadata(text, "/nonexistent/tessera-fuzz-ckpt");
    (void)tessera::checkpoint::to_json(m);
  } catch (const std::exception&) {
  }
  return 0;
}
