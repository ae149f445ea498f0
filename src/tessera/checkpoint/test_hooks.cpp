// test_hooks.h: the faults (set_async_save_hook_for_tests is save_async.cpp's, beside the
// thread it hooks).
#include "tessera/checkpoint/test_hooks.h"

#include "tessera/checkpoint/storage/file.h"
#include "tessera/core/env.h"
#include "tessera/core/error.h"
#include "tessera/core/strings.h"

namespace tessera::checkpoint {

void flip_byte(const std::string& path, uint64_t at) {
  char c = 0;
  File(path, "r").pread_exact(at, &c, 1);
  c = static_cast<char>(~c);
  File f(path, "u");
  f.pwrite_exact(at, &c, 1);
  f.fsync();
}

bool test_fault(int rank, const char* what) {
  return env::get("TESSERA_TEST_SAVE_FAULT") == concat(rank, ":", what);
}

}  // namespace tessera::checkpoint
