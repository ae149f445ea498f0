// Any byte string given to the safetensors reader must end in a valid reader or a
// tessera::Error / c10::Error — never a crash, a hang, an over-read or a huge allocation.
#include <cstdint>
#include <exception>

#include "fuzz_common.h"
#include "tessera/checkpoint/format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size);
  try {
    tessera::checkpoint::SafetensorsReader r(path);
    for (const auto& e : r.entries()) {
      if (e.nbytes() <= (16u << 20)) (void)r.read(e.name);
    }
  } catch (const std::exception&) {
  }
  return 0;
}
