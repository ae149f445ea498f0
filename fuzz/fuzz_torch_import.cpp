// torch.save files (zip + pickle) through Tessera's restricted unpickler: anything not
// a dict of tensors is refused with an error; nothing executes, nothing crashes.
#include <cstdint>
#include <exception>

#include "fuzz_common.h"
#include "tessera/checkpoint/interop/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string& path = tessera::fuzz::write_input(data, size);
  try {
    (void)tessera::checkpoint::import_torch_file(path);
  } catch (const std::exception&) {
  }
  return 0;
}
